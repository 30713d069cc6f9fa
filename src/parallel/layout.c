// layout.c: the tensor x pipeline x data parallel layout of the world
// (comm.h's fl_layout) in Megatron's order, TP fastest, then DP, then PP:
// rank = tp + t*dp + t*d*pp. Each group is one fl_comm_split of the world
// whose color is the coordinates its ranks share; the split numbers a
// group's ranks in world order, which is the order of the coordinate that
// varies within it (the key Megatron gives MPI).
#include "fitlm/comm.h"

#include "fitlm/core.h"

static void check(int world, int t, int p) {
    if (t < 1 || p < 1)
        fl_die("tensor-parallel size %d and pipeline-parallel size %d must each be at least 1", t,
               p);
    if (world % (t * p) != 0)
        fl_die("%d ranks do not split into tensor-parallel groups of %d times pipeline stages of "
               "%d: the world must be a multiple of %d",
               world, t, p, t * p);
}

void fl_layout_coords(int world, int t, int p, int rank, int *tp_rank, int *dp_rank, int *pp_rank) {
    check(world, t, p);
    FL_ASSERT(rank >= 0 && rank < world);
    int d = world / (t * p);
    *tp_rank = rank % t;
    *dp_rank = rank / t % d;
    *pp_rank = rank / (t * d);
}

void fl_layout_init(fl_layout *l, int t, int p) {
    const fl_comm_group *world = fl_comm_world();
    int n = fl_comm_group_size(world), rank = fl_comm_group_rank(world);
    check(n, t, p);
    *l = (fl_layout){.world = n, .rank = rank, .tp = t, .pp = p, .dp = n / (t * p)};
    fl_layout_coords(n, t, p, rank, &l->tp_rank, &l->dp_rank, &l->pp_rank);
    int d = l->dp;
    l->tp_group = fl_comm_split(world, l->dp_rank + d * l->pp_rank);
    l->dp_group = fl_comm_split(world, l->tp_rank + t * l->pp_rank);
    l->pp_group = fl_comm_split(world, l->tp_rank + t * l->dp_rank);
    l->mp_group = fl_comm_split(world, l->dp_rank);
}

void fl_layout_free(fl_layout *l) {
    fl_comm_group_free(l->tp_group);
    fl_comm_group_free(l->dp_group);
    fl_comm_group_free(l->pp_group);
    fl_comm_group_free(l->mp_group);
    *l = (fl_layout){0};
}
