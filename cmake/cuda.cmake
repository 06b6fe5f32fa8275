# The optional CUDA implementation (csrc/cuda). Included from the top-level CMakeLists.txt after
# the _C target exists. Sets FSDPCHECK_BUILT_CUDA.
set(FSDPCHECK_BUILT_CUDA OFF)
string(TOUPPER "${FSDPCHECK_CUDA}" FSDPCHECK_CUDA)
if(NOT FSDPCHECK_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "FSDPCHECK_CUDA must be AUTO, ON or OFF, got '${FSDPCHECK_CUDA}'")
endif()
if(FSDPCHECK_CUDA STREQUAL "OFF")
  message(STATUS "fsdpcheck: CUDA implementation off (FSDPCHECK_CUDA=OFF)")
  return()
endif()

# Why CUDA cannot be built, or empty.
set(_fsdpcheck_no_cuda "")
if(TORCH_CUDA_VERSION STREQUAL "")
  set(_fsdpcheck_no_cuda "torch ${TORCH_VERSION} is not a CUDA build")
endif()

# Find the real toolkit. The nvcc on PATH may be a wrapper script living elsewhere, so ask nvcc
# where its toolkit is (its TOP) instead of guessing from its location.
if(NOT _fsdpcheck_no_cuda)
  if(DEFINED ENV{CUDACXX})
    set(_nvcc "$ENV{CUDACXX}")
  elseif(DEFINED ENV{CUDA_HOME})
    set(_nvcc "$ENV{CUDA_HOME}/bin/nvcc")
  else()
    # PATH first, then the usual install place (a bare GPU machine has nvcc there, off PATH).
    find_program(_nvcc nvcc HINTS /usr/local/cuda/bin)
  endif()
  if(NOT _nvcc OR NOT EXISTS "${_nvcc}")
    set(_fsdpcheck_no_cuda "nvcc was not found (set CUDA_HOME or CUDACXX, or put nvcc on PATH or in /usr/local/cuda/bin)")
  else()
    execute_process(COMMAND "${_nvcc}" --dryrun -c -x cu /dev/null -o /dev/null
                    ERROR_VARIABLE _nvcc_out OUTPUT_VARIABLE _nvcc_out2 RESULT_VARIABLE _nvcc_rc)
    string(REGEX MATCH "#\\$ TOP=([^\n]*)" _top_line "${_nvcc_out}${_nvcc_out2}")
    if(CMAKE_MATCH_1)
      get_filename_component(_cuda_root "${CMAKE_MATCH_1}" REALPATH)
    else()
      get_filename_component(_cuda_root "${_nvcc}" REALPATH)
      get_filename_component(_cuda_root "${_cuda_root}" DIRECTORY)
      get_filename_component(_cuda_root "${_cuda_root}" DIRECTORY)
    endif()
    if(NOT EXISTS "${_cuda_root}/bin/nvcc")
      set(_fsdpcheck_no_cuda "no CUDA toolkit found at ${_cuda_root} (from ${_nvcc})")
    endif()
  endif()
endif()

if(_fsdpcheck_no_cuda)
  if(FSDPCHECK_CUDA STREQUAL "ON")
    message(FATAL_ERROR "fsdpcheck: FSDPCHECK_CUDA=ON but ${_fsdpcheck_no_cuda}.")
  endif()
  message(STATUS "fsdpcheck: building without CUDA: ${_fsdpcheck_no_cuda}")
  return()
endif()

set(CMAKE_CUDA_COMPILER "${_cuda_root}/bin/nvcc")
set(CUDAToolkit_ROOT "${_cuda_root}")
set(CMAKE_CUDA_HOST_COMPILER "${CMAKE_CXX_COMPILER}")
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  if(DEFINED ENV{FSDPCHECK_CUDA_ARCHS})
    set(CMAKE_CUDA_ARCHITECTURES "$ENV{FSDPCHECK_CUDA_ARCHS}")
  else()
    execute_process(COMMAND nvidia-smi -L RESULT_VARIABLE _smi_rc OUTPUT_QUIET ERROR_QUIET)
    if(_smi_rc EQUAL 0)
      set(CMAKE_CUDA_ARCHITECTURES native)
    else()
      set(CMAKE_CUDA_ARCHITECTURES "80;90")
    endif()
  endif()
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

target_sources(_C PRIVATE csrc/cuda/compare_cuda.cpp csrc/cuda/compare_kernels.cu)
target_link_libraries(_C PRIVATE CUDA::cudart "${TORCH_LIB_DIR}/libc10_cuda${CMAKE_SHARED_LIBRARY_SUFFIX}")
# The target exists already, so the CMAKE_CUDA_* defaults above do not reach it: set them on it.
set_target_properties(_C PROPERTIES
  CUDA_RUNTIME_LIBRARY Shared
  CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}"
  CUDA_STANDARD 20
  CUDA_STANDARD_REQUIRED ON)
string(REPLACE ";" "," _archs "${CMAKE_CUDA_ARCHITECTURES}")
target_compile_definitions(_C PRIVATE
  FSDPCHECK_CUDA_VERSION="${CMAKE_CUDA_COMPILER_VERSION}"
  FSDPCHECK_CUDA_ARCHS="${_archs}")
# Device code multiplies and adds tolerances with non-fusing intrinsics; host code of the .cu is
# built like the rest (NOTE: [no contraction] in elementwise.h).
target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-ffp-contract=off>)
if(FSDPCHECK_WERROR)
  target_compile_options(_C PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings -Xcompiler=-Werror>)
endif()
set(FSDPCHECK_BUILT_CUDA ON)
message(STATUS "fsdpcheck: CUDA implementation on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
