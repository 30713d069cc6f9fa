// build.c: which build this is, for the ranks of a run to agree on
// (src/run/agree.c): the commit it was configured from (CMakeLists.txt
// passes git describe's) and the compiler.
#include "fitlm/core.h"

#ifndef FITLM_BUILD_COMMIT
#define FITLM_BUILD_COMMIT "unknown"
#endif

const char *fl_build_id(void) {
    return FITLM_BUILD_COMMIT ", compiler " __VERSION__;
}
