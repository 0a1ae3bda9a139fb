// Moving one layer's weights between a module and host tensors (detail::HostLayerTensors, the
// form runtime/tp_shard cuts into tensor-parallel shards): used by the driver's --tp mode and
// by the tests that compare sharded ranks with a TP = 1 module.
#pragma once

#include "kda/prefill.h"
#include "testing/tp_shard.h"

namespace kda::detail {

// The LayerWeights view of host tensors for PrefillModule::upload_layer_weights (in_proj_rows 0:
// W_in rows, which upload pads). Points into `t`, which must outlive the upload.
LayerWeights host_weights_view(const HostLayerTensors& t);

// One layer's weights of the module's model, read back from the device (W_in rows of in_proj,
// not the padding). Synchronous; throws kda::Error when a copy fails.
HostLayerTensors download_layer_tensors(const PrefillModule& module, int layer);

}  // namespace kda::detail
