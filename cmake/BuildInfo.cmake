# Writes the build facts header (src/core/build_info_generated.h.in -> OUTPUT) with the git commit of SOURCE_DIR.
# Runs at every build (the tern_build_info_header target in src/core); configure_file leaves OUTPUT untouched when
# nothing changed, so only a new HEAD, or the tree turning dirty or clean, recompiles build_info.cc.
# Outside a git checkout (a tarball), or without git, the commit is "unknown" and the build goes on.
set(TERN_COMMIT unknown)
if(GIT_EXECUTABLE)
  execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${SOURCE_DIR}" rev-parse --show-toplevel
                  OUTPUT_VARIABLE top RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(rc EQUAL 0)
    file(REAL_PATH "${top}" top)
    file(REAL_PATH "${SOURCE_DIR}" source)
  endif()
  # Only tern's own checkout counts: a tarball unpacked inside some other repository has no commit of its own.
  if(rc EQUAL 0 AND top STREQUAL source)
    execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${SOURCE_DIR}" rev-parse --short HEAD
                    OUTPUT_VARIABLE hash RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(rc EQUAL 0 AND hash MATCHES "^[0-9a-f]+$")
      set(TERN_COMMIT "${hash}")
      # Changes to tracked files only (as git describe --dirty); --no-optional-locks: never write the index.
      execute_process(COMMAND "${GIT_EXECUTABLE}" --no-optional-locks -C "${SOURCE_DIR}" status --porcelain
                              --untracked-files=no
                      OUTPUT_VARIABLE changes RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      if(NOT rc EQUAL 0 OR NOT changes STREQUAL "")
        string(APPEND TERN_COMMIT "-dirty")
      endif()
    endif()
  endif()
endif()
configure_file("${TEMPLATE}" "${OUTPUT}" @ONLY)
