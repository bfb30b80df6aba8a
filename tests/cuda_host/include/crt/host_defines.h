// Stand-in for the CUDA toolkit's compiler-internal crt/host_defines.h, which the nvidia
// pip wheels do not ship but their vector_types.h and cuda_runtime_api.h include. It gives
// the host (g++) meaning to the decorations those headers use; the CUDA keywords the
// kernels themselves use (__global__, __shared__, ...) are defined in ../../shim.h first.
#pragma once
#define __HOST_DEFINES_H__
#define __no_return__ __attribute__((noreturn))
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __inline_hint__
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __annotate__(a)
#define __location__(a)
#define __specialization_static
#define __grid_constant__
#define __constant__
#define __managed__
#define __nv_pure__
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#define __cluster_dims__(...)
#define __maxnreg__(a)
#define __local_maxnreg__(a)
#define __launch_bounds__(...)
#define CUDARTAPI
#define CUDARTAPI_CDECL
