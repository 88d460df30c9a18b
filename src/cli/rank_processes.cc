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
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>

extern char** environ;

namespace tern {
namespace {

// The rank processes learn their parent's pid from this variable (adopt_parent_lifetime).
constexpr const char* kParentPidVariable = "TERN_RANK_PARENT_PID";
// How long node 0 waits at exit for its rank processes to stop by themselves (they do once its runner has sent them
// the stop) before killing them.
constexpr auto kExitGrace = std::chrono::seconds(10);
// A rank process that ends before the group has formed stops node 0 this long after (so that node 0's own error,
// when it has the same one, is the one printed).
constexpr auto kEarlyExitDelay = std::chrono::seconds(1);
// Options node 0 gives its rank processes itself: the user's are dropped from their command line.
constexpr std::string_view kNodeOptions[] = {"--nnodes", "--node-rank", "--dist-init-addr"};

std::vector<std::string>& command_line() {
  static std::vector<std::string> args;
  return args;
}

// One rank process. Its watcher thread alone waits for it (waitpid), so its pid is never reused while `done` is
// false and may be signalled until then.
struct Child {
  pid_t pid = 0;
  int node = 0;  // its --node-rank
  std::atomic<bool> done{false};
};

std::mutex children_mutex;
std::vector<std::shared_ptr<Child>>& children() {
  static std::vector<std::shared_ptr<Child>> list;
  return list;
}
std::atomic<bool> group_formed{false};

std::string exit_reason(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {}", WTERMSIG(status));
  return "ended";
}

// Waits for the rank process; one that ends before the group has formed stops node 0 with its status (it would
// otherwise wait for it until --dist-timeout).
void watch(std::shared_ptr<Child> child) {
  int status = 0;
  while (waitpid(child->pid, &status, 0) < 0 && errno == EINTR) {
  }
  child->done = true;
  if (group_formed) return;
  std::this_thread::sleep_for(kEarlyExitDelay);
  if (group_formed) return;
  fmt::print(stderr, "tern: the rank process of node {} {} before the ranks formed their group; stopping\n",
             child->node, exit_reason(status));
  std::fflush(stderr);
  _exit(WIFEXITED(status) && WEXITSTATUS(status) != 0 ? WEXITSTATUS(status) : 1);
}

void kill_children() {
  std::lock_guard lock(children_mutex);
  for (const auto& child : children()) {
    if (!child->done) kill(child->pid, SIGKILL);
  }
}

// At exit: every rank process given the grace period to stop, then killed; their watchers reap them.
void stop_children() {
  group_formed = true;  // an exit now is node 0's own: no watcher reports it
  const auto all_done = [] {
    std::lock_guard lock(children_mutex);
    return std::all_of(children().begin(), children().end(), [](const auto& c) { return c->done.load(); });
  };
  const auto wait_until = [&](std::chrono::steady_clock::time_point deadline) {
    while (!all_done() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  };
  wait_until(std::chrono::steady_clock::now() + kExitGrace);
  if (all_done()) return;
  kill_children();
  wait_until(std::chrono::steady_clock::now() + std::chrono::seconds(2));
}

// The user's command line without the options node 0 sets for its rank processes ("--opt value" or "--opt=value").
std::vector<std::string> rank_command_line() {
  std::vector<std::string> out;
  const std::vector<std::string>& in = command_line();
  for (size_t i = 0; i < in.size(); ++i) {
    const std::string_view a = in[i];
    const auto named = [&](std::string_view opt) { return a == opt || a.starts_with(std::string(opt) + "="); };
    const auto it = std::find_if(std::begin(kNodeOptions), std::end(kNodeOptions), named);
    if (it == std::end(kNodeOptions)) {
      out.push_back(in[i]);
    } else if (a == *it) {
      ++i;  // and its value
    }
  }
  return out;
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

Expected<void> start_rank_processes(int nodes, const std::string& addr, const std::vector<std::string>& extra_args) {
  if (command_line().empty()) return make_error("the rank processes need the command line (set_command_line)");
  // The list is made before the handler is registered, so that it is destroyed after the handler has run.
  (void)children();
  static const bool registered = std::atexit(stop_children) == 0;
  if (!registered) return make_error("cannot register the rank processes' clean-up at exit");
  group_formed = false;
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!std::string_view(*e).starts_with(std::string(kParentPidVariable) + "=")) env.emplace_back(*e);
  }
  env.push_back(fmt::format("{}={}", kParentPidVariable, getpid()));
  // CPU ranks compute with OpenMP, whose threads spin while they wait: the machine's cores shared among the ranks
  // unless the user chose a count.
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env.push_back(fmt::format("OMP_NUM_THREADS={}", std::max(1u, cores / static_cast<unsigned>(nodes))));
  }
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> base = rank_command_line();
  base.insert(base.end(), extra_args.begin(), extra_args.end());
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, STDERR_FILENO, STDOUT_FILENO);  // node 0's stdout is its output
  for (int node = 1; node < nodes; ++node) {
    std::vector<std::string> args = base;
    for (const std::string& a : {std::string("--nnodes"), std::to_string(nodes), std::string("--node-rank"),
                                 std::to_string(node), std::string("--dist-init-addr"), addr}) {
      args.push_back(a);
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    auto child = std::make_shared<Child>();
    child->node = node;
    const int rc = posix_spawn(&child->pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
    if (rc != 0) {
      posix_spawn_file_actions_destroy(&actions);
      group_formed = true;  // the error below is the report
      kill_children();
      return make_error("cannot start the rank process of node {}: {}", node, std::strerror(rc));
    }
    {
      std::lock_guard lock(children_mutex);
      children().push_back(child);
    }
    std::thread(watch, child).detach();
  }
  posix_spawn_file_actions_destroy(&actions);
  return {};
}

void rank_processes_formed_group() {
  group_formed = true;
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
