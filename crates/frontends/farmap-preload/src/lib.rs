//! `libfarmap_preload.so`, the `LD_PRELOAD` library of `farmap run -- PROGRAM`
//! (docs/design/farmap-run.md §3): it replaces the program's malloc family and C++
//! operators with [farmap-heap](farmap_heap) over a userfaultfd region that `farmap run`
//! serves and bounds, paging it to a store, while the program uses it as plain memory.
//!
//! # Modes
//! - **Region mode** (`FARMAP_RUN_SOCK` set): the constructor connects to that Unix socket
//!   and runs the handshake of [farmap-run-proto](farmap_run_proto) (below); the heap is
//!   served from the region it maps and registers. After the verdict the same socket
//!   belongs to the *reaper* thread, which does `farmap run`'s discards and moves.
//! - **Plain mode** (no `FARMAP_RUN_SOCK`): the heap is farmap-heap over 64 GiB of private
//!   anonymous `MAP_NORESERVE` memory (it costs what is touched). Useful on its own, and how
//!   the library is tested under real programs.
//!
//! `FARMAP_PRELOAD_DEBUG=1` prints one line on stderr at exit: the mode and how many
//! allocations each heap served (`main_allocs`, `boot_allocs`, `child_allocs`).
//!
//! # The contract with `farmap run`
//! - Environment: `FARMAP_RUN_SOCK` (path of a Unix stream socket), `FARMAP_RUN_TOKEN` (64
//!   hex digits: the 32-byte token), `FARMAP_RUN_OPTIONAL=1` (a failed handshake falls back
//!   to plain mode instead of exiting with status 127 after one line on stderr),
//!   `FARMAP_RUN_OPEN_AT=BYTES` (the session opens once the heap would hold that many bytes,
//!   checked at every allocation of 64 KiB or more and every 32nd smaller one; until then
//!   the boot heap serves, mode `lazy`; unset or 0: at start-up).
//! - Handshake: send `Hello{token, pid}`; read `Config{region_len, chunk_size, trash_len,
//!   features}`; open the region's userfaultfd with `Config.features` (without fork events
//!   if the program may not have them) and the staging
//!   area's with `UFFD_FEATURE_MOVE` only (both `O_CLOEXEC | O_NONBLOCK`); map the region
//!   (`region_len`) and the staging area (`region_len + trash_len`), both private anonymous
//!   `MAP_NORESERVE`; register the region `MISSING | WP` and the staging area `WP`;
//!   `MADV_DONTFORK` the staging area (and the region, unless it has fork events); open `/proc/self/pagemap` and `/proc/self/mem`; send
//!   `Registered{region, region_len, staging, staging_len, features}` with four fds (region
//!   uffd, staging uffd, pagemap, mem: SCM_RIGHTS); read the `Verdict`. Requests that come
//!   before the verdict are served by the handshake itself. The program keeps its own
//!   copies of the userfaultfds for its whole life (closing the last copy would unregister
//!   the areas and let faults through as zeros); pagemap and mem are closed once sent.
//! - The reaper thread (all signals blocked, no allocation, never touches region memory)
//!   reads `Request{id, op}` and answers `Done{id, errno, bytes}`: `Discard` is
//!   `madvise(MADV_DONTNEED)`, `Move` is `UFFDIO_MOVE` on the *destination's* userfaultfd
//!   (bytes moved and errno: `EEXIST`, `ENOENT`, `EAGAIN`, `EBUSY` come back with the
//!   partial count). A range outside the program's two areas is refused with `EINVAL`,
//!   untouched. On end of file or any socket error the reaper kills the program
//!   (`SIGKILL`): nobody would serve its faults.
//! - Every fd the library makes is close-on-exec: an exec ends the session, and the new
//!   image (`LD_PRELOAD` is still set) starts a new one.
//!
//! # Inside
//! - The first allocation, whoever makes it (ld.so, the constructors of the program's
//!   libraries, which run before this library's), makes a *boot heap* over 1 GiB of plain
//!   memory (an atomic state machine: empty, making, ready). The constructor (an
//!   `.init_array` entry) reads the environment from the `envp` glibc passes it, opens the
//!   session and sets the *main heap*; from then on new allocations come from it. `free`,
//!   `realloc` and `malloc_usable_size` find the owning heap by address; a boot object that
//!   is reallocated moves to the main heap.
//! - No TLS, no `dlsym`, no `std::env`; system calls are raw (rustix's `linux_raw`
//!   backend, no libc symbol this library may export). The heaps pick an arena by the
//!   thread pointer. Rust-internal allocations (a panic) go to a bump arena of their own (a
//!   `#[global_allocator]`), never to the program's heaps.
//! - Purges of free spans of 1 MiB and more are `madvise(MADV_DONTNEED)`: in the region it
//!   raises a REMOVE event that `farmap run` reads before the call returns (and then treats
//!   those pages as zeros). farmap-heap purges with its span lock held; `farmap run` never
//!   needs the program's locks to read the event, so that wait is bounded.
//! - `pthread_atfork` takes every heap lock before a fork and releases them in both
//!   processes.
//!
//! # Limits (this step)
//! - **fork**: with fork events (`Config.features` has `UFFD_FEATURE_EVENT_FORK`, and the
//!   program may have them: CAP_SYS_PTRACE), the region is inherited. The atfork prepare
//!   handler (every heap lock held) announces the fork on a connection of its own
//!   (`ForkPrepare`) and waits until `farmap run` has paused the pager; the parent closes
//!   that connection after the fork; the child waits on its copy for a second `Verdict`
//!   (its heap is whole), then closes the session's fds and runs on with the main heap, now
//!   plain memory of its own (mode `inherited`). Without fork events the region and the
//!   staging area are `MADV_DONTFORK`: a child gets a plain heap of its own for new
//!   allocations (so fork + exec, and children that allocate, work); an object of the
//!   parent's heap does not exist in the child: touching it faults (SIGSEGV), loudly.
//!   Children made with `vfork` or `posix_spawn` share or skip the heap and work.
//! - **Statically linked programs** and programs that call the `mmap`/`brk` system calls
//!   themselves are not interposed; **setuid** programs ignore `LD_PRELOAD`.
//! - `mmap`, `munmap`, `mremap` and `madvise` are not interposed yet (step 7): `MAP_SHARED`
//!   and large anonymous mappings a program makes itself stay outside the region.
//! - A program that closes or `dup2`s over the session's fds loses its reaper (then it is
//!   killed) or its own userfaultfd copies. `FARMAP_RUN_FD_BASE=N` (optional) moves the
//!   socket and the two userfaultfds to `N` or above, out of the way of most such habits.
//! - With `vm.overcommit_memory = 2` the 64 GiB plain heap cannot be mapped; plain mode then
//!   serves everything from the 1 GiB boot heap (and says so on stderr).
//! - jemalloc's extended API (`mallocx`, `nallocx`, `mallctl`, ...) is not interposed: redis
//!   calls `nallocx` (a size hint) and `mallctl` (statistics of jemalloc's unused arenas),
//!   which is harmless; a program that frees with `sdallocx` would not be.
//! - `mallopt`, `mallinfo` and `malloc_trim` are glibc's (they act on glibc's unused arena).
//! - `operator new` that finds no memory prints one line and aborts (no `bad_alloc`, no
//!   `new_handler`).
//! - Never *link* this crate into a binary (its rlib exists so that cargo builds the `.so`
//!   for crates that depend on it): its exported `malloc` would replace that binary's.
//!
//! # Safety
//! This crate is unsafe by nature (it is the program's allocator); every `unsafe` block
//! says which invariant holds and who keeps it. The exported symbols are not built for the
//! crate's own unit tests.
#![warn(missing_docs)]
// The unit tests build the crate without its exports, which use most of it.
#![cfg_attr(test, allow(dead_code))]

mod backing;
mod env;
#[cfg(not(test))]
mod exports;
#[cfg(not(test))]
mod global;
mod heaps;
mod session;
mod sys;

#[cfg(not(test))]
#[global_allocator]
static GLOBAL: global::Bump = global::Bump;
