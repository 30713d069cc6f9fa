// in_child.h: the CUDA emulator's tests of its own contract (test_wmma.cu,
// test_mma.cu; C++ only): a use of CUDA that a GPU would reject must stop
// the emulated run, so each one runs in a child process.
#ifndef FITLM_CUDA_EMU_IN_CHILD_H
#define FITLM_CUDA_EMU_IN_CHILD_H

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "cuda_runtime.h"

// Runs bad(arg) and a synchronisation in a child; returns what it wrote on
// stderr, and in *stopped whether it stopped with abort (the emulator's
// way of stopping a run).
template <class A> std::string in_child(void (*bad)(A), A arg, bool *stopped) {
    int fd[2];
    if (pipe(fd)) abort();
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        dup2(fd[1], 2);
        bad(arg);
        cudaDeviceSynchronize();
        _exit(0);
    }
    close(fd[1]);
    std::string err;
    char buf[512];
    ssize_t got;
    while ((got = read(fd[0], buf, sizeof buf)) > 0) err.append(buf, (size_t)got);
    close(fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    *stopped = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
    return err;
}

#endif
