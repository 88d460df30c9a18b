# Shared helpers: warnings for tern's own code, libraries, tests and benchmarks.

set(TERN_SOURCE_ROOT ${PROJECT_SOURCE_DIR}/src)
set(TERN_FIXTURES_DIR ${PROJECT_SOURCE_DIR}/tests/fixtures)

# Warnings are errors for our own code only; third-party headers come in as SYSTEM includes.
function(tern_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Werror -Wno-missing-field-initializers>
    # g++ 12 at -O3 reports std::string copies inside libstdc++ as overlapping (GCC bug 105329, a false positive).
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-restrict>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
endfunction()

# tern_library(NAME SOURCES ... [DEPS ...])
function(tern_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${TERN_SOURCE_ROOT})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
  tern_warnings(${name})
endfunction()

# tern_test(NAME SOURCES ... [DEPS ...] [LABELS ...]): one gtest binary; each TEST is its own ctest entry.
function(tern_test name)
  if(NOT TERN_BUILD_TESTS)
    return()
  endif()
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE
    TERN_FIXTURES_DIR="${TERN_FIXTURES_DIR}"
    TERN_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
    TERN_BINARY_DIR="${PROJECT_BINARY_DIR}")
  tern_warnings(${name})
  set(labels unit)
  if(ARG_LABELS)
    set(labels ${ARG_LABELS})
  endif()
  gtest_discover_tests(${name} DISCOVERY_MODE PRE_TEST PROPERTIES LABELS "${labels}")
endfunction()

# tern_benchmark(NAME SOURCES ... [DEPS ...]): Google Benchmark binary, never run by ctest.
function(tern_benchmark name)
  if(NOT TERN_BUILD_BENCHMARKS)
    return()
  endif()
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} benchmark::benchmark)
  target_compile_definitions(${name} PRIVATE TERN_FIXTURES_DIR="${TERN_FIXTURES_DIR}")
  tern_warnings(${name})
endfunction()
