// KDA_HOST_DEVICE marks functions that run on both sides: __host__ __device__ under nvcc,
// nothing under a plain C++ compiler (host code and the CPU emulation tests include the same
// headers).
#pragma once

#if defined(__CUDACC__)
#define KDA_HOST_DEVICE __host__ __device__
#else
#define KDA_HOST_DEVICE
#endif
