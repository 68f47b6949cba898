/*
 * evpleg's pause image entrypoint: the pod sandbox's init process.
 *
 * It does what the Kubernetes pause container does for the tests: sleeps until
 * SIGTERM or SIGINT, and reaps every child that is re-parented to it (it is PID 1
 * of the pod's PID namespace when the pod shares one). Built statically by the
 * test harness (tests/src/containerd.rs) with `gcc -static -O2`.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stop_signal;

static void on_stop(int sig) { stop_signal = sig; }

static void on_child(int sig) {
    (void)sig;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        printf("evpleg-pause 1\n");
        return 0;
    }
    if (getpid() != 1) {
        fprintf(stderr, "evpleg-pause: warning: not running as PID 1\n");
    }

    struct sigaction stop = {0};
    stop.sa_handler = on_stop;
    sigemptyset(&stop.sa_mask);
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0) {
        perror("evpleg-pause: sigaction(SIGINT/SIGTERM)");
        return 1;
    }

    struct sigaction child = {0};
    child.sa_handler = on_child;
    child.sa_flags = SA_NOCLDSTOP | SA_RESTART;
    sigemptyset(&child.sa_mask);
    if (sigaction(SIGCHLD, &child, NULL) < 0) {
        perror("evpleg-pause: sigaction(SIGCHLD)");
        return 2;
    }

    /* Block the signals and wait for them with sigsuspend, so that one arriving
     * between the check and the wait cannot be lost. */
    sigset_t blocked, waiting;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGINT);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &blocked, &waiting) < 0) {
        perror("evpleg-pause: sigprocmask");
        return 3;
    }
    sigdelset(&waiting, SIGINT);
    sigdelset(&waiting, SIGTERM);
    sigdelset(&waiting, SIGCHLD);
    while (!stop_signal) {
        sigsuspend(&waiting);
    }
    fprintf(stderr, "evpleg-pause: shutting down, got signal %d\n", (int)stop_signal);
    return 0;
}
