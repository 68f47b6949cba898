/*
 * The programs of critest's web-server and setuid images, built locally
 * (tests/src/critest.rs); chosen by the name it runs as:
 *
 * - nginx: serves HTTP (busybox httpd) on 80, or on the port of `-p PORT`,
 *   as a master process whose command line says `nginx: master process`
 *   and whose pid is in /var/run/nginx.pid (critest's PID namespace tests
 *   read both);
 * - httpd-foreground: serves HTTP on 80 and says `httpd` on stdout (critest
 *   looks for it in the container's log);
 * - nnp: prints `Effective uid: <euid>` (installed setuid root: with
 *   no_new_privs the bit is ignored).
 *
 * The server forks busybox httpd and waits for it; as pid 1 it ends it on
 * SIGTERM, so that a stop is immediate.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static pid_t child;

static void stop(int sig) {
	(void)sig;
	if (child > 0)
		kill(child, SIGKILL);
	_exit(0);
}

static int serve(const char *port, const char *root) {
	signal(SIGTERM, stop);
	signal(SIGINT, stop);
	signal(SIGQUIT, stop);
	child = fork();
	if (child < 0) {
		perror("fork");
		return 1;
	}
	if (child == 0) {
		execl("/bin/busybox", "httpd", "-f", "-p", port, "-h", root, (char *)NULL);
		perror("exec /bin/busybox httpd");
		_exit(127);
	}
	int status;
	while (waitpid(child, &status, 0) < 0)
		;
	return 1;
}

int main(int argc, char **argv) {
	const char *name = strrchr(argv[0], '/');
	name = name ? name + 1 : argv[0];
	if (strcmp(name, "nnp") == 0) {
		printf("Effective uid: %d\n", (int)geteuid());
		return 0;
	}
	if (strcmp(name, "httpd-foreground") == 0) {
		printf("httpd: serving on port 80\n");
		fflush(stdout);
		return serve("80", "/usr/local/apache2/htdocs");
	}
	if (strstr(argv[0], "master process") == NULL) {
		/* Again, under the name nginx's master process shows. */
		char *again[] = {"nginx: master process nginx", NULL};
		const char *port = "80";
		for (int i = 1; i + 1 < argc; i++)
			if (strcmp(argv[i], "-p") == 0)
				port = argv[i + 1];
		setenv("CRITEST_PORT", port, 1);
		execv("/usr/sbin/nginx", again);
		perror("exec /usr/sbin/nginx");
		return 127;
	}
	FILE *pid = fopen("/var/run/nginx.pid", "w");
	if (pid) {
		fprintf(pid, "%d\n", (int)getpid());
		fclose(pid);
	}
	const char *port = getenv("CRITEST_PORT");
	return serve(port ? port : "80", "/usr/share/nginx/html");
}
