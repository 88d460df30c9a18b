#include "cli/rank_processes.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

extern char** environ;

namespace tern {
namespace {

// The rank processes learn their parent's pid from this variable (adopt_parent_lifetime).
constexpr const char* kParentPidVariable = "TERN_RANK_PARENT_PID";
// How long node 0 waits at exit for its rank processes to stop by themselves (they do once its runner has sent them
// the stop) before killing them.
constexpr auto kExitGrace = std::chrono::seconds(10);

std::vector<std::string>& command_line() {
  static std::vector<std::string> args;
  return args;
}

std::mutex children_mutex;
std::vector<pid_t>& children() {
  static std::vector<pid_t> pids;
  return pids;
}

// Waits for every rank process, up to the grace period, then kills and reaps the rest.
void reap_children() {
  std::lock_guard lock(children_mutex);
  const auto deadline = std::chrono::steady_clock::now() + kExitGrace;
  for (const pid_t pid : children()) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  children().clear();
}

}  // namespace

void set_command_line(int argc, const char* const* argv) {
  command_line().assign(argv, argv + argc);
}

Expected<std::string> free_loopback_addr() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return make_error("cannot open a socket for the rank processes' rendezvous: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int err = errno;
  close(fd);
  if (!ok) return make_error("cannot pick a loopback port for the rank processes' rendezvous: {}", std::strerror(err));
  return fmt::format("127.0.0.1:{}", ntohs(a.sin_port));
}

Expected<void> start_rank_processes(int world, const std::string& addr) {
  if (command_line().empty()) return make_error("the rank processes need the command line (set_command_line)");
  // The list is made before the handler is registered, so that it is destroyed after the handler has run.
  (void)children();
  static const bool reaper = std::atexit(reap_children) == 0;
  if (!reaper) return make_error("cannot register the rank processes' clean-up at exit");
  const std::string parent = std::to_string(getpid());
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!std::string_view(*e).starts_with(std::string(kParentPidVariable) + "=")) env.emplace_back(*e);
  }
  env.push_back(std::string(kParentPidVariable) + "=" + parent);
  // CPU ranks compute with OpenMP, whose threads spin while they wait: the machine's cores shared among the ranks
  // unless the user chose a count.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env.push_back(fmt::format("OMP_NUM_THREADS={}", std::max(1u, cores / static_cast<unsigned>(world))));
  }
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  for (int rank = 1; rank < world; ++rank) {
    std::vector<std::string> args = command_line();
    for (const std::string& a : {std::string("--nnodes"), std::to_string(world), std::string("--node-rank"),
                                 std::to_string(rank), std::string("--dist-init-addr"), addr}) {
      args.push_back(a);
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);  // node 0's stdout is its output
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      {
        std::lock_guard lock(children_mutex);
        for (const pid_t child : children()) kill(child, SIGKILL);
      }
      reap_children();
      return make_error("cannot start the process of tensor-parallel rank {}: {}", rank, std::strerror(rc));
    }
    std::lock_guard lock(children_mutex);
    children().push_back(pid);
  }
  return {};
}

void adopt_parent_lifetime() {
  const char* parent = std::getenv(kParentPidVariable);
  if (parent == nullptr) return;
  // Sent when the thread that started this process ends: start_rank_processes runs on node 0's main thread, which
  // ends only with the process.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (std::to_string(getppid()) != parent) _exit(1);  // the parent died before the line above
}

}  // namespace tern
