# Where the build finds what it takes from Python packages, and how it copies them.

# pij_find_python_deps(<ffi include var> <nanobind package dir var>): XLA's FFI headers (inside
# jaxlib) and nanobind's package directory, from PIJ_XLA_FFI_SRC / PIJ_NANOBIND_SRC where the
# pip build passed them (cmake/pip_build.cmake), else from ${Python_EXECUTABLE}. jaxlib from the
# environment Python runs in, else (`-I`) from the interpreter's own environment: under pip's
# isolated build that is the environment being installed into, whose jaxlib the build
# environment does not repeat (cmake/pij_build.py).
string(CONCAT pij_jaxlib_include_probe
       "import os, jaxlib; print(os.path.join(os.path.dirname(os.path.abspath(jaxlib.__file__)), "
       "'include'))")
function(pij_find_python_deps ffi_var nanobind_var)
  set(ffi "${PIJ_XLA_FFI_SRC}")
  if(ffi AND NOT EXISTS "${ffi}/xla/ffi/api/ffi.h")
    message(FATAL_ERROR "PIJ_XLA_FFI_SRC=${ffi}: expected a folder with xla/ffi/api/ffi.h")
  endif()
  set(why "")
  foreach(isolated IN ITEMS "" "-I")
    if(ffi)
      break()
    endif()
    execute_process(
      COMMAND "${Python_EXECUTABLE}" ${isolated} -c "${pij_jaxlib_include_probe}"
      OUTPUT_VARIABLE ffi OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE result
      ERROR_VARIABLE err ERROR_STRIP_TRAILING_WHITESPACE)
    if(NOT result EQUAL 0 OR NOT EXISTS "${ffi}/xla/ffi/api/ffi.h")
      string(APPEND why "\n  ${Python_EXECUTABLE} ${isolated}: ${err}${ffi}")
      set(ffi "")
    endif()
  endforeach()
  if(NOT EXISTS "${ffi}/xla/ffi/api/ffi.h")
    message(FATAL_ERROR "Could not find XLA FFI headers in jaxlib "
                        "(is jaxlib installed for ${Python_EXECUTABLE}?):${why}")
  endif()
  set(nb "${PIJ_NANOBIND_SRC}")
  if(NOT nb)
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -m nanobind --cmake_dir
      OUTPUT_VARIABLE nb_cmake OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE result)
    if(NOT result EQUAL 0 OR NOT EXISTS "${nb_cmake}")
      message(FATAL_ERROR "Could not find nanobind via `python -m nanobind --cmake_dir` "
                          "(is nanobind installed for ${Python_EXECUTABLE}?)")
    endif()
    get_filename_component(nb "${nb_cmake}" DIRECTORY)
  endif()
  set(${ffi_var} "${ffi}" PARENT_SCOPE)
  set(${nanobind_var} "${nb}" PARENT_SCOPE)
endfunction()

# pij_sync_tree(<src> <dst>): make <dst> hold every file of <src>, writing only the files whose
# contents differ, so that an unchanged file keeps its timestamp and nothing that includes it is
# compiled again. Python caches are skipped.
function(pij_sync_tree src dst)
  file(GLOB_RECURSE files LIST_DIRECTORIES false RELATIVE "${src}" "${src}/*")
  foreach(f IN LISTS files)
    if(f MATCHES "(^|/)__pycache__/")
      continue()
    endif()
    get_filename_component(dir "${dst}/${f}" DIRECTORY)
    file(MAKE_DIRECTORY "${dir}")
    file(COPY_FILE "${src}/${f}" "${dst}/${f}" ONLY_IF_DIFFERENT)
  endforeach()
endfunction()
