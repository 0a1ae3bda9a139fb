// PrefillModule diagnostics: self_check (graph replay vs eager, packed conv vs the stock path,
// bitwise) and profile_steps (each step's GPU time). Debug paths: they allocate and synchronise.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "common/bit_compare.h"
#include "common/check.h"
#include "common/cuda_check.h"
#include "common/device_memory.h"
#include "conv/stock_conv.h"
#include "runtime/module_impl.h"

namespace kda {

using detail::str_cat;

namespace {
int64_t diff_bytes_bits(const std::vector<unsigned char>& a, const std::vector<unsigned char>& b) {
  return detail::diff_bits(a.data(), b.data(), std::min(a.size(), b.size()));
}
}  // namespace

std::vector<StepTiming> PrefillModule::profile_steps(const BatchView& batch, int layer, Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::profile_steps";
  Impl& m = *impl_;
  const detail::DeviceGuard on_device(m.device, fn);
  m.check_layer_ready(layer, fn);
  begin_forward(batch, stream);
  using Run = std::function<void(const detail::StepInputs&, Stream)>;
  std::vector<StepTiming> out;
  std::vector<Run> steps;
  m.for_each_step([&](const std::string& name, Run run) {
    out.push_back(StepTiming{name, 0.0});
    steps.push_back(std::move(run));
  });
  const std::size_t n = steps.size();
  std::deque<detail::Event> events;  // Event does not move: a deque builds them in place
  for (std::size_t i = 0; i <= n; ++i) events.emplace_back(detail::Event::Timing::On);
  // From here the batch runs this layer: run_layer(layer) refuses it after, and a failure part
  // way marks the batch failed, naming what was written, as in run_layer.
  m.ledger.layer_started(layer);
  for (int w = 0; w < static_cast<int>(m.windows.size()); ++w) {
    try {
      const detail::StepInputs in = m.inputs(layer, w, m.windows[w].bucket);
      KDA_CUDA_CHECK(fn, cudaEventRecord(events[0].get(), stream));
      for (std::size_t i = 0; i < n; ++i) {
        Impl::run_step(out[i].name, steps[i], in, stream);
        KDA_CUDA_CHECK(fn, cudaEventRecord(events[i + 1].get(), stream));
      }
      m.ledger.window_ran(layer, w);
      KDA_CUDA_CHECK(fn, cudaEventSynchronize(events[n].get()));
      for (std::size_t i = 0; i < n; ++i) out[i].gpu_us += events[i + 1].elapsed_ms_since(events[i]) * 1e3;
    } catch (const std::exception& e) {
      const std::string written = m.ledger.failed(layer, w, e.what(), "profile_steps");
      KDA_FAIL(fn, "layer ", layer, " window ", w, " failed: ", e.what(), "; ", written);
    }
  }
  ++m.eager_runs;
  return out;
}

SelfCheckReport PrefillModule::self_check(const BatchView& batch, Stream stream) {
  constexpr const char* fn = "kda::PrefillModule::self_check";
  Impl& m = *impl_;
  const detail::DeviceGuard on_device(m.device, fn);
  for (int l = 0; l < m.num_layers; ++l) m.check_layer_ready(l, fn);
  begin_forward(batch, stream);  // validates first: a bad batch throws here, changing nothing

  const int64_t T = batch.num_tokens();
  const std::size_t plane_bytes = static_cast<std::size_t>(T * m.program.P) * 2;  // real rows of one plane
  const std::size_t cap_plane_bytes = static_cast<std::size_t>(m.program.capacity * m.program.P) * 2;
  const int nwin = static_cast<int>(m.windows.size());
  auto copy = [&](void* dst, const void* src, std::size_t bytes) {
    if (bytes) KDA_CUDA_CHECK(fn, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  };
  auto download = [&](const void* src, std::size_t bytes) {
    std::vector<unsigned char> h(bytes);
    if (bytes) KDA_CUDA_CHECK(fn, cudaMemcpyAsync(h.data(), src, bytes, cudaMemcpyDeviceToHost, stream));
    KDA_CUDA_CHECK(fn, cudaStreamSynchronize(stream));
    return h;
  };
  // A layer's pool: lines [0, cache_lines) of its line stride. Copies keep that geometry (the
  // stock baseline runs on a copy with the module's strides) and move only the lines'
  // elements, never what lies between lines (an external pool's gaps are the server's).
  struct PoolGeometry {
    int64_t stride, line;  // elements
    std::size_t elem;      // bytes per element (pools.conv_dtype / pools.recurrent_dtype)
  };
  const int64_t lines = m.config.pools.cache_lines;
  auto conv_geo = [&](int l) {
    return PoolGeometry{m.pools[l].conv_line_stride, m.config.conv_line_elems(), dtype_size(m.config.pools.conv_dtype)};
  };
  auto rec_geo = [&](int l) {
    return PoolGeometry{m.pools[l].recurrent_line_stride, m.config.recurrent_line_elems(),
                        dtype_size(m.config.pools.recurrent_dtype)};
  };
  auto copy_lines = [&](void* dst, const void* src, PoolGeometry g) {
    const std::size_t pitch = static_cast<std::size_t>(g.stride) * g.elem;
    KDA_CUDA_CHECK(fn, cudaMemcpy2DAsync(dst, pitch, src, pitch, static_cast<std::size_t>(g.line) * g.elem,
                                         static_cast<std::size_t>(lines), cudaMemcpyDeviceToDevice, stream));
  };
  auto download_lines = [&](const void* src, PoolGeometry g) {  // packed on the host
    const std::size_t width = static_cast<std::size_t>(g.line) * g.elem;
    std::vector<unsigned char> h(width * static_cast<std::size_t>(lines));
    KDA_CUDA_CHECK(fn, cudaMemcpy2DAsync(h.data(), width, src, static_cast<std::size_t>(g.stride) * g.elem, width,
                                         static_cast<std::size_t>(lines), cudaMemcpyDeviceToHost, stream));
    KDA_CUDA_CHECK(fn, cudaStreamSynchronize(stream));
    return h;
  };
  // Real rows [0, T) of the three planes, packed.
  auto copy_planes = [&](char* dst) {
    for (int i = 0; i < 3; ++i) copy(dst + i * plane_bytes, m.program.planes.as<char>() + i * cap_plane_bytes, plane_bytes);
  };

  // Starting pools, the eager pass's planes (per layer) and pools.
  std::vector<detail::DeviceBuffer> snap_conv, snap_rec, eager_conv, eager_rec, stock_conv;
  detail::DeviceBuffer eager_planes(3 * plane_bytes * m.num_layers, "self_check eager planes");
  // The layer output's real rows, per layer (runtime.layer_steps: full).
  const std::size_t out_bytes = m.program.full_layer() ? static_cast<std::size_t>(T * m.program.D) * 2 : 0;
  detail::DeviceBuffer eager_out(out_bytes * m.num_layers, "self_check eager outputs");
  for (int l = 0; l < m.num_layers; ++l) {
    snap_conv.emplace_back(m.conv_span_bytes(l), "self_check pool snapshot");
    snap_rec.emplace_back(m.rec_span_bytes(l), "self_check pool snapshot");
    eager_conv.emplace_back(m.conv_span_bytes(l), "self_check eager pools");
    eager_rec.emplace_back(m.rec_span_bytes(l), "self_check eager pools");
    stock_conv.emplace_back(m.conv_span_bytes(l), "self_check stock conv pool");
    copy_lines(snap_conv[l].get(), m.pools[l].conv, conv_geo(l));
    copy_lines(snap_rec[l].get(), m.pools[l].recurrent, rec_geo(l));
    copy_lines(stock_conv[l].get(), m.pools[l].conv, conv_geo(l));
  }
  // The stock baseline writes planes laid out like the module's: (3, padded_rows, P).
  const int64_t stock_plane_elems = m.program.padded_rows * m.program.P;
  detail::DeviceBuffer stock_planes(static_cast<std::size_t>(3 * stock_plane_elems) * 2, "self_check stock planes");
  std::size_t stock_ws_bytes = 0;
  for (int w = 0; w < nwin; ++w) {
    PackedConvArgs a = detail::conv_args_for_step(m.inputs(0, w, m.windows[w].bucket).ctx);
    stock_ws_bytes = std::max(stock_ws_bytes, baseline::stock_causal_conv1d_workspace_bytes(a));
  }
  detail::DeviceBuffer stock_ws(stock_ws_bytes, "self_check stock workspace");

  // From here the check writes the pools and runs every layer: run_layer refuses this batch
  // after, and a failure part way marks the batch failed (each sequence's lines may hold the
  // eager pass's, the graph pass's or a part of either). Before here nothing was written.
  m.ledger.all_ran();
  try {
    // Eager pass.
    for (int l = 0; l < m.num_layers; ++l) {
      for (int w = 0; w < nwin; ++w) m.run_window(l, w, Impl::Mode::Eager, stream);
      copy_planes(eager_planes.as<char>() + 3 * plane_bytes * l);
      copy(eager_out.as<char>() + out_bytes * l, m.program.output.get(), out_bytes);
    }
    for (int l = 0; l < m.num_layers; ++l) {
      copy_lines(eager_conv[l].get(), m.pools[l].conv, conv_geo(l));
      copy_lines(eager_rec[l].get(), m.pools[l].recurrent, rec_geo(l));
      copy_lines(m.pools[l].conv, snap_conv[l].get(), conv_geo(l));
      copy_lines(m.pools[l].recurrent, snap_rec[l].get(), rec_geo(l));
    }

    SelfCheckReport report;
    auto add = [&report](const std::string& what, int64_t bits, int64_t& total) {
      total += bits;
      report.detail += str_cat(what, ": ", bits, " differing bits\n");
    };
    if (!m.config.runtime.use_graphs) report.detail += "runtime.graphs is false: graphs recorded for this check only\n";

    // Graph pass; after each window the stock baseline convolves the same in_proj output from
    // its own copy of the starting conv pool, with the window's staged metadata. Rows the conv
    // does not write (skipped sequences) start equal: the stock planes take the module's. The
    // baseline's pool gets the window's conv checkpoints first, from its own lines, as the
    // module's steps do before the packed conv.
    for (int l = 0; l < m.num_layers; ++l) {
      for (int i = 0; i < 3; ++i)
        copy(stock_planes.as<char>() + i * stock_plane_elems * 2, m.program.planes.as<char>() + i * cap_plane_bytes, plane_bytes);
      for (int w = 0; w < nwin; ++w) {
        m.run_window(l, w, Impl::Mode::Replay, stream);
        const detail::StepInputs in = m.inputs(l, w, m.windows[w].bucket);
        if (m.config.runtime.max_checkpoints > 0) {
          ConvCheckpointArgs c = detail::conv_checkpoint_args_for_step(in);
          c.conv_states = stock_conv[l].get();
          conv_checkpoint(c, stream);
        }
        PackedConvArgs a = detail::conv_args_for_step(in.ctx);
        a.conv_states = stock_conv[l].get();
        a.out = stock_planes.as<char>() + w * m.program.B * m.program.P * 2;
        a.out_plane_stride = stock_plane_elems;
        baseline::stock_causal_conv1d(a, stock_ws.get(), stock_ws.bytes(), stream);
      }
      const auto eager_h = download(eager_planes.as<char>() + 3 * plane_bytes * l, 3 * plane_bytes);
      std::vector<unsigned char> graph_h(3 * plane_bytes), stock_h(3 * plane_bytes);
      for (int i = 0; i < 3; ++i) {
        auto g = download(m.program.planes.as<char>() + i * cap_plane_bytes, plane_bytes);
        auto s = download(stock_planes.as<char>() + i * stock_plane_elems * 2, plane_bytes);
        std::copy(g.begin(), g.end(), graph_h.begin() + i * plane_bytes);
        std::copy(s.begin(), s.end(), stock_h.begin() + i * plane_bytes);
      }
      add(str_cat("layer ", l, " planes (", T, " rows), graph vs eager"), diff_bytes_bits(graph_h, eager_h),
          report.graph_vs_eager_diff_bits);
      add(str_cat("layer ", l, " planes (", T, " rows), packed conv vs stock"), diff_bytes_bits(graph_h, stock_h),
          report.conv_vs_stock_diff_bits);
      if (out_bytes) {
        // Output rows of skipped sequences are unspecified (BatchView): o_proj reads recurrence
        // rows nobody wrote for them, which hold whatever the last forward left. They are not
        // compared.
        auto graph_out = download(m.program.output.get(), out_bytes);
        auto eager_out_h = download(eager_out.as<char>() + out_bytes * l, out_bytes);
        const std::size_t row_bytes = static_cast<std::size_t>(m.program.D) * 2;
        int64_t skipped_rows = 0;
        for (int64_t q = 0; q < batch.num_seqs; ++q) {
          if (batch.cache_indices[q] != m.config.pools.null_line) continue;
          const int64_t r0 = batch.query_start_loc[q], r1 = batch.query_start_loc[q + 1];
          skipped_rows += r1 - r0;
          std::fill(graph_out.begin() + r0 * row_bytes, graph_out.begin() + r1 * row_bytes, 0);
          std::fill(eager_out_h.begin() + r0 * row_bytes, eager_out_h.begin() + r1 * row_bytes, 0);
        }
        add(str_cat("layer ", l, " output (", T - skipped_rows, " rows of sequences that ran), graph vs eager"),
            diff_bytes_bits(graph_out, eager_out_h), report.graph_vs_eager_diff_bits);
      }
    }
    for (int l = 0; l < m.num_layers; ++l) {
      const auto conv_g = download_lines(m.pools[l].conv, conv_geo(l));
      add(str_cat("layer ", l, " conv pool, graph vs eager"),
          diff_bytes_bits(conv_g, download_lines(eager_conv[l].get(), conv_geo(l))), report.graph_vs_eager_diff_bits);
      add(str_cat("layer ", l, " conv pool, packed conv vs stock"),
          diff_bytes_bits(conv_g, download_lines(stock_conv[l].get(), conv_geo(l))), report.conv_vs_stock_diff_bits);
      add(str_cat("layer ", l, " recurrent pool, graph vs eager"),
          diff_bytes_bits(download_lines(m.pools[l].recurrent, rec_geo(l)), download_lines(eager_rec[l].get(), rec_geo(l))),
          report.graph_vs_eager_diff_bits);
    }
    report.ok = report.graph_vs_eager_diff_bits == 0 && report.conv_vs_stock_diff_bits == 0;
    return report;
  } catch (const std::exception& e) {
    KDA_FAIL(fn, "failed: ", e.what(), "; ", m.ledger.failed_all("self_check", e.what()));
  }
}

}  // namespace kda
