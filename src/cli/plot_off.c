// plot_off.c: `fitlm plot` in a build without cairo (FITLM_PLOT=OFF, as a
// GPU machine's build may be): a clear error instead of figures.
#include "cli.h"

#include <stdio.h>

int cmd_plot(int argc, char **argv) {
    (void)argc, (void)argv;
    fprintf(stderr, "fitlm plot: this build has no plotting (configured with FITLM_PLOT=OFF: "
                    "cairo was not available); rebuild with cairo (libcairo2-dev) to draw "
                    "figures\n");
    return 1;
}
