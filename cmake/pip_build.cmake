# The build under pip (scikit-build-core): the modules come from a nested build of this same
# project in <build dir>/native, which this one drives and installs from.
#
# Why nested: pip builds in a new isolated environment (a new temporary directory) every time,
# and scikit-build-core, seeing another environment, deletes the build directory's
# CMakeCache.txt and CMakeFiles/, where every object file lives: each `pip install -e .`
# compiled all sources again (about 4-5 minutes on 2 cores) even with nothing changed. The
# nested build directory is left alone, and it compiles against copies of the headers it takes
# from the build environment (XLA's FFI, nanobind) at fixed paths (pij_sync_tree), so its
# compile commands and dependencies stay the same: a re-install with nothing changed compiles
# nothing, and one after an edit compiles what the edit touched.
include(ExternalProject)
include(${CMAKE_CURRENT_LIST_DIR}/python_deps.cmake)

pij_find_python_deps(pij_ffi_src pij_nanobind_src)

# The options given to this build (-Ccmake.define.PIJ_ISA=avx2, PIJ_CUDA, the compilers, the
# CUDA architectures...) go to the nested one.
set(pij_forward)
get_cmake_property(pij_vars CACHE_VARIABLES)
foreach(var IN LISTS pij_vars)
  if(var MATCHES "^(PIJ_.*|CMAKE_BUILD_TYPE|CMAKE_CXX_COMPILER|CMAKE_CXX_FLAGS|CMAKE_CUDA_.*|CMAKE_CXX_COMPILER_LAUNCHER|Python_EXECUTABLE|Python_ROOT_DIR|Python_INCLUDE_DIR)$"
     AND NOT var MATCHES "^PIJ_(NESTED|XLA_FFI_SRC|NANOBIND_SRC)$")
    get_property(type CACHE "${var}" PROPERTY TYPE)
    if(type STREQUAL "INTERNAL" OR type STREQUAL "STATIC")
      continue()
    elseif(type STREQUAL "UNINITIALIZED")  # given as -DNAME=value, without a type
      set(type STRING)
    endif()
    list(APPEND pij_forward "-D${var}:${type}=${${var}}")
  endif()
endforeach()

set(pij_native "${PROJECT_BINARY_DIR}/native")
ExternalProject_Add(pij_native
  SOURCE_DIR "${PROJECT_SOURCE_DIR}"
  BINARY_DIR "${pij_native}"
  CMAKE_GENERATOR "${CMAKE_GENERATOR}"
  CMAKE_CACHE_ARGS ${pij_forward}
    -DPIJ_NESTED:BOOL=ON
    "-DPIJ_XLA_FFI_SRC:PATH=${pij_ffi_src}"
    "-DPIJ_NANOBIND_SRC:PATH=${pij_nanobind_src}"
  # the nested build decides what is out of date (nothing, after an unchanged re-install)
  BUILD_ALWAYS ON
  # compiler lines stream as the pip build's own do (pip install -v)
  BUILD_COMMAND "${CMAKE_COMMAND}" --build "${pij_native}" --verbose
  INSTALL_COMMAND ""
  USES_TERMINAL_CONFIGURE ON
  USES_TERMINAL_BUILD ON)

install(FILES "${pij_native}/_pij_ext.${SKBUILD_SOABI}${CMAKE_SHARED_MODULE_SUFFIX}"
        DESTINATION powerinfer_jax)
if(PIJ_CUDA)
  install(FILES "${pij_native}/_pij_cuda.${SKBUILD_SOABI}${CMAKE_SHARED_MODULE_SUFFIX}"
          DESTINATION powerinfer_jax)
endif()
