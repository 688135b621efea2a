/*
 * vmcheck: the self-checking guest of farmap's VM tests and benchmarks (docs/design/vm.md §7).
 *
 * It keeps rewriting a working set with a known pattern at a set rate, checks every byte of
 * a page before it rewrites it, and reports on its standard output (the serial console):
 *
 *   VMCHECK ready ws_mib=N rate_mibs=R seed=S pages=P
 *   VMCHECK t_ms=.. gen=.. pages=.. mibs=.. max_gap_us=.. mismatches=..   (every --report-ms)
 *   VMCHECK MISMATCH page=.. word=.. want=0x.. got=0x..                  (the first 8 words)
 *   VMCHECK done pages=.. mismatches=N                                   (after `check`/`stop`)
 *
 * Heartbeats: every --hb-pages pages it writes one byte to the I/O port --port (0xe9:
 * QEMU's isa-debugcon), a sequence number counting 0..255 and around; the stream starts
 * with the magic pair 0xFA 0xCE. The host stamps each byte on arrival, so a stop of the VM
 * (which the guest's own clocks do not see under TCG) shows as a gap between two bytes.
 *
 * Commands on standard input (the console), one per line: `check` verifies the whole working
 * set and prints `VMCHECK done`; `stop` does the same and exits (0 when nothing mismatched);
 * `corrupt` flips one bit of a page behind the check's back (to test the check itself).
 *
 * Options take `--key value` or `--key=value`; when none are given, they are read from the
 * kernel command line as `vmcheck.key=value` tokens (so one initramfs serves every size):
 *   --ws-mib N       working set (default 64)
 *   --rate-mibs N    rewrite rate, or 0 / `max` for as fast as it goes (default 64)
 *   --seed N         pattern seed (default 1)
 *   --hb-pages N     pages per heartbeat (default 16)
 *   --port N         heartbeat port (default 0xe9; 0 = none)
 *   --report-ms N    report period (default 500)
 *
 * Build: gcc -O2 -static -Wall -Wextra -Werror -o vmcheck vmcheck.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/io.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096u
#define WORDS (PAGE / 8u)
#define MAX_REPORTED_MISMATCHES 8

struct opts {
	uint64_t ws_mib, rate_mibs, seed, hb_pages, port, report_ms;
};

static struct opts opt = {64, 64, 1, 16, 0xe9, 500};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* splitmix64's finaliser: a bijection with good avalanche. */
static uint64_t mix64(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	x ^= x >> 31;
	return x;
}

/* Word i of page p at generation g. Word 0 names the page and generation, so a mismatch
 * tells what the page held instead. */
static uint64_t word(uint64_t p, uint64_t g, uint64_t i)
{
	if (i == 0)
		return (p << 32) | (g & 0xffffffffu);
	return mix64(opt.seed ^ mix64(p * 0x9e3779b97f4a7c15ull + g) ^ (i << 52) ^ i);
}

static uint64_t *ws;
static uint32_t *gen;
static uint64_t npages;
static uint64_t mismatches;
static uint64_t reported;

static void fill(uint64_t p, uint64_t g)
{
	uint64_t *w = ws + p * WORDS;
	for (uint64_t i = 0; i < WORDS; i++)
		w[i] = word(p, g, i);
}

/* Checks page p against its generation; returns whether it matched. */
static int check(uint64_t p)
{
	const uint64_t *w = ws + p * WORDS;
	int bad = 0;
	for (uint64_t i = 0; i < WORDS; i++) {
		uint64_t want = word(p, gen[p], i);
		if (w[i] == want)
			continue;
		if (reported < MAX_REPORTED_MISMATCHES) {
			reported++;
			printf("VMCHECK MISMATCH page=%" PRIu64 " word=%" PRIu64 " want=0x%016" PRIx64
			       " got=0x%016" PRIx64 "\n",
			       p, i, want, w[i]);
			fflush(stdout);
		}
		bad = 1;
	}
	if (bad)
		mismatches++;
	return !bad;
}

static void beat(uint8_t b)
{
	if (opt.port)
		outb(b, (unsigned short)opt.port);
}

static int set_opt(const char *key, const char *val)
{
	char *end;
	uint64_t v;
	if (!strcmp(key, "rate-mibs") && !strcmp(val, "max")) {
		opt.rate_mibs = 0;
		return 0;
	}
	errno = 0;
	v = strtoull(val, &end, 0);
	if (errno || *end || end == val) {
		fprintf(stderr, "vmcheck: --%s needs a number, not '%s'\n", key, val);
		return -1;
	}
	if (!strcmp(key, "ws-mib"))
		opt.ws_mib = v;
	else if (!strcmp(key, "rate-mibs"))
		opt.rate_mibs = v;
	else if (!strcmp(key, "seed"))
		opt.seed = v;
	else if (!strcmp(key, "hb-pages"))
		opt.hb_pages = v;
	else if (!strcmp(key, "port"))
		opt.port = v;
	else if (!strcmp(key, "report-ms"))
		opt.report_ms = v;
	else {
		fprintf(stderr, "vmcheck: unknown option --%s\n", key);
		return -1;
	}
	return 0;
}

/* `key=value`, `--key=value` or `--key value` (the latter consumes next). */
static int parse_arg(const char *arg, const char *next, int *used_next)
{
	char key[64];
	const char *eq;
	*used_next = 0;
	if (!strncmp(arg, "--", 2))
		arg += 2;
	eq = strchr(arg, '=');
	if (eq) {
		size_t n = (size_t)(eq - arg);
		if (n >= sizeof key)
			return -1;
		memcpy(key, arg, n);
		key[n] = 0;
		return set_opt(key, eq + 1);
	}
	if (!next) {
		fprintf(stderr, "vmcheck: --%s needs a value\n", arg);
		return -1;
	}
	*used_next = 1;
	return set_opt(arg, next);
}

/* `vmcheck.key=value` tokens of the kernel command line. */
static int parse_cmdline(void)
{
	char buf[4096];
	ssize_t n;
	int fd = open("/proc/cmdline", O_RDONLY);
	if (fd < 0)
		return 0;
	n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	for (char *save = NULL, *tok = strtok_r(buf, " \n", &save); tok; tok = strtok_r(NULL, " \n", &save)) {
		int used;
		if (strncmp(tok, "vmcheck.", 8))
			continue;
		if (parse_arg(tok + 8, NULL, &used))
			return -1;
	}
	return 0;
}

/* A line from the console, if one is complete; non-blocking. */
static const char *console_line(void)
{
	static char buf[256];
	static size_t len;
	struct pollfd pfd = {.fd = 0, .events = POLLIN};
	if (poll(&pfd, 1, 0) <= 0 || !(pfd.revents & POLLIN))
		return NULL;
	ssize_t n = read(0, buf + len, sizeof buf - 1 - len);
	if (n <= 0)
		return NULL;
	len += (size_t)n;
	buf[len] = 0;
	char *nl = strpbrk(buf, "\r\n");
	if (!nl) {
		if (len == sizeof buf - 1)
			len = 0; /* an over-long line: dropped */
		return NULL;
	}
	*nl = 0;
	static char line[256];
	strcpy(line, buf);
	size_t rest = len - (size_t)(nl + 1 - buf);
	memmove(buf, nl + 1, rest);
	len = rest;
	return line;
}

static uint64_t verify_all(void)
{
	uint64_t before = mismatches;
	for (uint64_t p = 0; p < npages; p++)
		check(p);
	printf("VMCHECK done pages=%" PRIu64 " mismatches=%" PRIu64 "\n", npages, mismatches);
	fflush(stdout);
	return mismatches - before;
}

int main(int argc, char **argv)
{
	if (argc == 1 && parse_cmdline())
		return 2;
	for (int i = 1; i < argc; i++) {
		int used;
		if (parse_arg(argv[i], i + 1 < argc ? argv[i + 1] : NULL, &used))
			return 2;
		i += used;
	}
	if (!opt.ws_mib || !opt.hb_pages || !opt.report_ms) {
		fprintf(stderr, "vmcheck: --ws-mib, --hb-pages and --report-ms must be above 0\n");
		return 2;
	}
	if (opt.port && ioperm((unsigned long)opt.port, 1, 1)) {
		perror("vmcheck: ioperm (needs root)");
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	npages = opt.ws_mib << 8;
	size_t bytes = (size_t)(npages * PAGE);
	ws = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	gen = calloc(npages, sizeof *gen);
	uint64_t *perm = malloc(npages * sizeof *perm);
	if (ws == MAP_FAILED || !gen || !perm) {
		perror("vmcheck: cannot allocate the working set");
		return 2;
	}
	madvise(ws, bytes, MADV_HUGEPAGE);
	for (uint64_t p = 0; p < npages; p++) {
		fill(p, 0);
		perm[p] = p;
	}
	uint64_t rng = mix64(opt.seed + 12345);
	for (uint64_t i = npages - 1; i > 0; i--) {
		rng = mix64(rng);
		uint64_t j = rng % (i + 1), t = perm[i];
		perm[i] = perm[j];
		perm[j] = t;
	}
	beat(0xFA);
	beat(0xCE);
	printf("VMCHECK ready ws_mib=%" PRIu64 " rate_mibs=%" PRIu64 " seed=%" PRIu64 " pages=%" PRIu64 "\n",
	       opt.ws_mib, opt.rate_mibs, opt.seed, npages);

	uint64_t start = now_ns(), last_beat = start, next_report = start + opt.report_ms * 1000000u;
	uint64_t done = 0, pace_done = 0, pace_start = start, max_gap = 0, window_done = 0, window_start = start, g = 0;
	uint8_t seq = 0;
	for (;;) {
		for (uint64_t k = 0; k < npages; k++) {
			uint64_t p = perm[k];
			check(p);
			gen[p]++;
			fill(p, gen[p]);
			done++;
			if (done % opt.hb_pages)
				continue;
			uint64_t t = now_ns();
			if (t - last_beat > max_gap)
				max_gap = t - last_beat;
			last_beat = t;
			beat(seq++);
			if (opt.rate_mibs) {
				/* Pace: `done` pages should take done*PAGE/rate seconds. */
				uint64_t due = pace_start + (uint64_t)((unsigned __int128)(done - pace_done) * PAGE *
									 1000000000u / (opt.rate_mibs << 20));
				if (t > due + 50000000u) {
					/* Far behind (the VM was stopped, or is slower than the rate): start
					 * pacing again from here rather than catching up in a burst. */
					pace_start = t;
					pace_done = done;
				} else if (due > t) {
					struct timespec ts = {(time_t)((due - t) / 1000000000u), (long)((due - t) % 1000000000u)};
					nanosleep(&ts, NULL);
				}
			}
			if (t >= next_report) {
				double secs = (double)(t - window_start) / 1e9;
				printf("VMCHECK t_ms=%" PRIu64 " gen=%" PRIu64 " pages=%" PRIu64 " mibs=%.1f max_gap_us=%" PRIu64
				       " mismatches=%" PRIu64 "\n",
				       (t - start) / 1000000u, g, done, (double)((done - window_done) * PAGE) / 1048576.0 / secs,
				       max_gap / 1000u, mismatches);
				window_done = done;
				window_start = t;
				next_report = t + opt.report_ms * 1000000u;
				const char *cmd = console_line();
				if (cmd && !strcmp(cmd, "check"))
					verify_all();
				else if (cmd && !strcmp(cmd, "corrupt"))
					ws[perm[0] * WORDS + 7] ^= 1; /* for tests of the check itself */
				else if (cmd && !strcmp(cmd, "stop"))
					return verify_all() || mismatches ? 1 : 0;
			}
		}
		g++;
	}
}
