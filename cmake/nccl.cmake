# The NCCL communicator backend, po_comm_nccl (src/comm/nccl, docs/comm.md).
# PO_NCCL=AUTO builds it when nvcc, the CUDA runtime and NCCL >= 2.18
# (ncclCommSplit) are all found, and otherwise says what is missing and skips
# it; ON makes a missing piece a configure error; OFF skips it. Targets that
# link po_comm_nccl get PO_HAVE_NCCL=1. Nothing here is needed for the rest of
# the build. Included from the top CMakeLists after po_comm is defined.
#
# Where to look: nvcc on PATH (or CUDACXX / -DCMAKE_CUDA_COMPILER), then NCCL
# in $NCCL_HOME or next to the CUDA toolkit (-DPO_NCCL_INCLUDE_DIR /
# -DPO_NCCL_LIBRARY override). GPU code is built for sm_80 (A100) and sm_90
# (H100/H200), each with its PTX for newer GPUs, unless CMAKE_CUDA_ARCHITECTURES
# is given.
set(PO_NCCL "AUTO" CACHE STRING "NCCL communicator backend: AUTO | ON | OFF (docs/comm.md)")
set_property(CACHE PO_NCCL PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${PO_NCCL}" _po_nccl_mode)
if(NOT _po_nccl_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "PO_NCCL must be AUTO, ON or OFF, got '${PO_NCCL}'")
endif()

set(_po_nccl_missing "")
if(NOT _po_nccl_mode STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    list(APPEND _po_nccl_missing "a working CUDA compiler (nvcc)")
  else()
    # Use the toolkit that holds this nvcc, not another one found elsewhere.
    if(NOT DEFINED CUDAToolkit_ROOT)
      get_filename_component(_po_cuda_bin "${CMAKE_CUDA_COMPILER}" DIRECTORY)
      get_filename_component(CUDAToolkit_ROOT "${_po_cuda_bin}" DIRECTORY)
    endif()
    find_package(CUDAToolkit QUIET)
    if(NOT CUDAToolkit_FOUND)
      list(APPEND _po_nccl_missing "the CUDA toolkit (cudart)")
    endif()
  endif()
  find_path(PO_NCCL_INCLUDE_DIR nccl.h
            HINTS ENV NCCL_HOME ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(PO_NCCL_LIBRARY nccl
               HINTS ENV NCCL_HOME ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  if(NOT PO_NCCL_INCLUDE_DIR OR NOT PO_NCCL_LIBRARY)
    list(APPEND _po_nccl_missing "NCCL (nccl.h and libnccl: set NCCL_HOME)")
  else()
    file(STRINGS "${PO_NCCL_INCLUDE_DIR}/nccl.h" _po_nccl_defs
         REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
    set(PO_NCCL_VERSION "")
    foreach(_part MAJOR MINOR PATCH)
      string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _m "${_po_nccl_defs}")
      list(APPEND PO_NCCL_VERSION "${CMAKE_MATCH_1}")
    endforeach()
    list(JOIN PO_NCCL_VERSION "." PO_NCCL_VERSION)
    if(PO_NCCL_VERSION VERSION_LESS 2.18)
      list(APPEND _po_nccl_missing "NCCL >= 2.18 (found ${PO_NCCL_VERSION} in ${PO_NCCL_INCLUDE_DIR})")
    endif()
  endif()
endif()

if(_po_nccl_mode STREQUAL "OFF")
  message(STATUS "PagedOptim NCCL backend: off (PO_NCCL=OFF)")
elseif(_po_nccl_missing)
  list(JOIN _po_nccl_missing ", " _po_nccl_why)
  if(_po_nccl_mode STREQUAL "ON")
    message(FATAL_ERROR "PO_NCCL=ON but the NCCL backend needs: ${_po_nccl_why}")
  endif()
  message(STATUS "PagedOptim NCCL backend: skipped, not found: ${_po_nccl_why} (PO_NCCL=AUTO)")
else()
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
  enable_language(CUDA)
  add_library(po_comm_nccl STATIC
    ${CMAKE_SOURCE_DIR}/src/comm/nccl/communicator.cc
    ${CMAKE_SOURCE_DIR}/src/comm/nccl/convert.cu)
  target_include_directories(po_comm_nccl SYSTEM PUBLIC ${PO_NCCL_INCLUDE_DIR})
  target_link_libraries(po_comm_nccl PUBLIC po_comm CUDA::cudart ${PO_NCCL_LIBRARY})
  target_compile_definitions(po_comm_nccl PUBLIC PO_HAVE_NCCL=1)
  # The shared cudart, as CUDA::cudart: one runtime per process, shared with NCCL's callers.
  set_target_properties(po_comm_nccl PROPERTIES
    CUDA_RUNTIME_LIBRARY Shared CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  message(STATUS "PagedOptim NCCL backend: on (NCCL ${PO_NCCL_VERSION} ${PO_NCCL_LIBRARY}, "
                 "CUDA ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES})")
endif()
