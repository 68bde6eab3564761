# The BLAS behind backend::cpu::gemm, chosen by measurement (docs/blas.md).
# Every choice links the OpenMP build of the library, so the BLAS and our own
# OpenMP kernels share ONE libgomp thread pool (two spinning pools on 2 cores
# fight). Debian ships these variants in per-threading subdirectories.
add_library(po_blas INTERFACE)
set(_po_libdir /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE})
if(NOT CMAKE_LIBRARY_ARCHITECTURE)
  set(_po_libdir /usr/lib/x86_64-linux-gnu)
endif()
if(PO_BLAS STREQUAL "openblas")
  # The default libopenblas.so is the pthread build; take the OpenMP one.
  find_library(PO_OPENBLAS_OMP_LIB NAMES libopenblas.so.0 openblas
               PATHS ${_po_libdir}/openblas-openmp NO_DEFAULT_PATH)
  if(NOT PO_OPENBLAS_OMP_LIB)
    message(WARNING "OpenMP OpenBLAS not found; falling back to the default build")
    find_library(PO_OPENBLAS_OMP_LIB NAMES openblas REQUIRED)
  endif()
  set(PO_BLAS_LIB ${PO_OPENBLAS_OMP_LIB})
  find_path(PO_OPENBLAS_INCLUDE cblas.h PATHS
            /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp
            /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-pthread
            /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas
            NO_DEFAULT_PATH)
  target_include_directories(po_blas SYSTEM INTERFACE ${PO_OPENBLAS_INCLUDE})
  target_compile_definitions(po_blas INTERFACE PO_BLAS_OPENBLAS=1)
elseif(PO_BLAS STREQUAL "blis")
  find_library(PO_BLIS_OMP_LIB NAMES libblis.so.4 blis
               PATHS ${_po_libdir}/blis-openmp NO_DEFAULT_PATH)
  if(NOT PO_BLIS_OMP_LIB)
    find_library(PO_BLIS_OMP_LIB NAMES blis REQUIRED)
  endif()
  set(PO_BLAS_LIB ${PO_BLIS_OMP_LIB})
  find_path(PO_BLIS_INCLUDE blis.h PATHS
            /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/blis-openmp
            /usr/include/x86_64-linux-gnu/blis-openmp /usr/include/blis NO_DEFAULT_PATH)
  target_include_directories(po_blas SYSTEM INTERFACE ${PO_BLIS_INCLUDE})
  target_compile_definitions(po_blas INTERFACE PO_BLAS_BLIS=1)
elseif(PO_BLAS STREQUAL "dnnl")
  find_library(PO_DNNL_LIB NAMES dnnl REQUIRED)  # Debian's build uses OpenMP (libgomp)
  set(PO_BLAS_LIB ${PO_DNNL_LIB})
  target_compile_definitions(po_blas INTERFACE PO_BLAS_DNNL=1)
else()
  message(FATAL_ERROR "PO_BLAS must be openblas, blis or dnnl, got '${PO_BLAS}'")
endif()
target_link_libraries(po_blas INTERFACE ${PO_BLAS_LIB})
message(STATUS "PagedOptim GEMM backend: ${PO_BLAS} (${PO_BLAS_LIB})")
