#include "cli/serve_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "cli/model_options.h"
#include "cli/version_command.h"
#include "runtime/engine.h"
#include "server/http_server.h"

#ifndef TERN_DEMO_MODEL_DIR
#define TERN_DEMO_MODEL_DIR ""
#endif

namespace tern {
namespace {

struct ServeOptions {
  ModelCliOptions model;
  ServerConfig server;
  int32_t max_running = 64;
  int32_t max_queued = 256;
  int64_t max_total_tokens = 0;  // 0: enough for max_running full contexts, at most 1M
  int64_t context_length = 0;    // 0: the model's max_position_embeddings
  int64_t chunked_prefill = 2048;
  std::string reasoning_parser = "auto";
  std::string tool_parser = "auto";
  int speculative_disable_batch_size = 0;
  bool speculative_adaptive = false;
};

std::atomic<int> g_signal{0};
extern "C" void serve_on_signal(int sig) { g_signal.store(sig); }

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ToolFormat pick_tool_format(const ServeOptions& o, const ModelConfig& config, const std::optional<Tokenizer>& tok) {
  if (o.tool_parser != "auto") return *tool_format_from_name(o.tool_parser);
  std::string source = read_text(std::filesystem::path(o.model.model_dir) / "chat_template.jinja");
  if (tok && tok->chat_template()) source += *tok->chat_template();
  ToolFormat detected = tool_format_detect(source);
  if (detected != ToolFormat::kNone) return detected;
  // As SGLang's parsers: glm47 for GLM-4.7 / GLM-5 (glm_moe_dsa), glm45 for GLM-4.5 / 4.6 (glm4_moe).
  if (config.model_type == "glm_moe_dsa") return ToolFormat::kGlm47;
  if (config.model_type.starts_with("glm")) return ToolFormat::kGlm45;
  if (config.model_type.starts_with("qwen3_5")) return ToolFormat::kQwen3Xml;
  return config.model_type.starts_with("qwen") ? ToolFormat::kQwen3Json : ToolFormat::kNone;
}

int fail(const std::string& message) {
  spdlog::error("tern serve: {}", message);
  return 2;
}

Expected<EngineConfig> engine_config(ServeOptions& o, const ModelConfig& config) {
  if (o.context_length <= 0) o.context_length = config.max_position_embeddings > 0 ? config.max_position_embeddings : 4096;
  if (o.max_total_tokens <= 0) o.max_total_tokens = std::min<int64_t>(o.context_length * o.max_running, 1 << 20);
  if (o.max_total_tokens < o.context_length) {
    return make_error("--max-total-tokens ({}) must hold at least one full context (--context-length {})",
                      o.max_total_tokens, o.context_length);
  }
  if (o.max_running < 1 || o.max_queued < 0 || o.chunked_prefill < 1) {
    return make_error("--max-running-requests and --chunked-prefill-size must be >= 1, --max-queued-requests >= 0");
  }
  // The runner's block size: the scheduler hands it the block ids it allocates (runtime/scheduler.h).
  const auto kBlock = static_cast<int32_t>(DeviceModelOptions{}.kv_block_size);
  EngineConfig e;
  e.context_length = o.context_length;
  e.scheduler = {.max_running = o.max_running, .max_waiting = o.max_queued, .token_budget = o.chunked_prefill,
                 .block_size = kBlock,
                 .num_blocks = static_cast<int32_t>(KvBlockAllocator::blocks_for_tokens(o.max_total_tokens, kBlock))};
  e.speculative_steps = speculative_steps_of(o.model);
  e.speculative_disable_batch_size = o.speculative_disable_batch_size;
  e.speculative_adaptive = o.speculative_adaptive;
  return e;
}

int run_serve(ServeOptions& o) {
  std::signal(SIGPIPE, SIG_IGN);
  spdlog::info("{}", build_info_line(linked_library_versions()));
  if (o.model.model_dir.empty()) {
    o.model.model_dir = TERN_DEMO_MODEL_DIR;
    spdlog::info("no --model given: serving the demo model {} (a 4.7 M-parameter Qwen3.5-MoE miniature trained on "
                 "the Brown corpus, demo/README.md: English-like text, not a useful assistant)", o.model.model_dir);
  }
  const std::filesystem::path dir = o.model.model_dir;
  std::optional<Tokenizer> tokenizer;
  std::optional<ChatTemplateSet> templates;
  if (std::filesystem::exists(dir / "tokenizer.json")) {
    spdlog::info("loading the tokenizer from {}", (dir / "tokenizer.json").string());
    auto tok = Tokenizer::load(dir);
    if (!tok) return fail(tok.error().message);
    tokenizer.emplace(std::move(*tok));
    auto t = chat_templates_load_model(dir);
    if (t) {
      templates.emplace(std::move(*t));
    } else {
      spdlog::warn("no chat template ({}): /v1/chat/completions will answer 400", t.error().message);
    }
  } else {
    spdlog::warn("{} has no tokenizer.json: only /v1/completions with token-id prompts will work", dir.string());
  }
  spdlog::info("loading weights from {} (load format {})", dir.string(), o.model.load_format);
  const auto start = std::chrono::steady_clock::now();
  auto model_config = model_config_load(dir);
  if (!model_config) return fail(model_config.error().message);
  const bool total_given = o.max_total_tokens > 0;
  auto econfig = engine_config(o, *model_config);
  if (!econfig) return fail(econfig.error().message);
  // A step holds at most the prefill chunk plus one decode row (and its drafts) per running request. Without
  // --max-total-tokens a GPU's KV cache is sized from its free memory (as vLLM's --gpu-memory-utilization does), and
  // the scheduler is given what fit.
  const int64_t decode_rows = o.max_running * (1 + speculative_steps_of(o.model));
  const DeviceModelOptions sizes{.max_batch_tokens = o.chunked_prefill + decode_rows,
                                 .max_sequences = o.max_running,
                                 .kv_cache_tokens = total_given ? o.max_total_tokens : 0,
                                 .max_context_tokens = o.context_length};
  auto model = load_model_from_options(o.model, sizes);
  if (!model) return fail(model.error().message);
  if (const ModelRunner& runner = **model; !total_given && runner.kv_cache_tokens() > 0) {
    o.max_total_tokens = std::min(o.max_total_tokens, runner.kv_cache_tokens());
    if (o.max_total_tokens < o.context_length) {
      return fail(
          fmt::format("the KV cache that fits in device memory holds {} tokens, less than one full context "
                      "(--context-length {}); lower --context-length",
                      o.max_total_tokens, o.context_length));
    }
    econfig = engine_config(o, *model_config);
    if (!econfig) return fail(econfig.error().message);
  }
  spdlog::info("weights loaded in {:.2f} s", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  spdlog::info("running on {}", (*model)->describe());
  if (econfig->speculative_steps > 0) {
    spdlog::info("speculative decoding: the model's MTP layer drafts {} tokens per step{}{}",
                 econfig->speculative_steps,
                 o.speculative_disable_batch_size > 0
                     ? fmt::format(", none in steps of {} or more sequences", o.speculative_disable_batch_size)
                     : std::string(),
                 o.speculative_adaptive ? "; verified only at the batch sizes where the measured steps say it pays"
                                        : "");
  }
  const ModelConfig config = (*model)->config();
  if (o.server.served_model_name.empty()) o.server.served_model_name = dir.filename().string();
  o.server.context_length = o.context_length;
  o.server.reasoning = o.reasoning_parser != "none";
  o.server.tool_format = pick_tool_format(o, config, tokenizer);
  spdlog::info("tool-call parser: {}{}; reasoning parser: {}", tool_format_name(o.server.tool_format),
               o.tool_parser == "auto" ? " (auto)" : "", o.server.reasoning ? "<think> ... </think>" : "none");
  if (!config.eos_token_ids.empty()) {
    spdlog::info("end-of-sequence token ids (config.json and generation_config.json): {}",
                 fmt::join(config.eos_token_ids, ", "));
  }
  o.server.num_threads = std::min(1024, o.max_running + o.max_queued + 16);
  spdlog::info("context {} tokens, KV capacity {} tokens in {} blocks, {} running / {} queued requests at most",
               o.context_length, o.max_total_tokens, econfig->scheduler.num_blocks, o.max_running, o.max_queued);
  EngineMetrics metrics;
  Engine engine(std::move(*model), tokenizer, *econfig, metrics);
  HttpServer server(o.server, engine, metrics, tokenizer, templates);
  std::signal(SIGTERM, serve_on_signal);
  std::signal(SIGINT, serve_on_signal);
  std::atomic<bool> done{false};
  std::thread watcher([&] {
    while (!done && g_signal.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (g_signal.load() != 0) {
      spdlog::info("signal {} received", g_signal.load());
      server.stop();
    }
  });
  auto ran = server.run();
  done = true;
  watcher.join();
  engine.shutdown();
  if (!ran) return fail(ran.error().message);
  spdlog::info("stopped");
  return 0;
}

}  // namespace

void register_serve_command(CLI::App& app) {
  auto o = std::make_shared<ServeOptions>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API");
  cmd->add_option("--model,--model-path", o->model.model_dir, "Checkpoint directory (default: the bundled demo)");
  cmd->add_option("--host", o->server.host, "Address to listen on");
  cmd->add_option("--port", o->server.port, "Port (0: any free port, printed in the log)")->check(CLI::Range(0, 65535));
  cmd->add_option("--device", o->model.device, "Where to run the model: cuda, cpu, or auto (cuda when this build has "
                 "it and a GPU is present)")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->add_option("--cuda-device", o->model.cuda_device, "CUDA device ordinal for --device cuda");
  cmd->add_option("--selftest", o->model.selftest, "Start-up self-test of every kernel on the model's shapes: fast, "
                  "full, off, or auto (fast on a GPU, off on the CPU)")->check(CLI::IsMember({"auto", "off", "fast", "full"}));
  add_parallel_options(*cmd, o->model);
  add_backend_options(*cmd, o->model.backends);
  cmd->add_option("--served-model-name", o->server.served_model_name, "Model name in the API (default: directory name)");
  // Every count is range-checked here, so that nothing later narrows or multiplies an absurd value.
  cmd->add_option("--max-running-requests", o->max_running, "Most requests in the running batch")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}));
  cmd->add_option("--max-queued-requests", o->max_queued, "Most requests waiting; more get 503")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  cmd->add_option("--max-total-tokens", o->max_total_tokens, "KV-cache capacity in tokens over all requests")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--context-length", o->context_length, "Most tokens per request, prompt and output")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--chunked-prefill-size", o->chunked_prefill, "Most tokens per forward step")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_option("--api-key", o->server.api_key, "Require 'Authorization: Bearer KEY'");
  cmd->add_option("--max-body-bytes", o->server.max_body_bytes, "Largest request body (bigger: 413)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--request-read-timeout", o->server.request_read_timeout_s, "Seconds from a request's first byte "
                  "to the last byte of its body (slower: 408 and the connection closes)")
      ->check(CLI::Range(1, 3600));
  cmd->add_option("--reasoning-parser", o->reasoning_parser, "Split <think> reasoning from the answer")
      ->check(CLI::IsMember({"auto", "qwen3", "glm45", "none"}));
  cmd->add_option("--tool-call-parser", o->tool_parser, "Tool-call format of the model's output")
      ->check(CLI::IsMember({"auto", "qwen3", "qwen3_coder", "glm45", "glm47", "none"}));
  cmd->add_option("--load-format", o->model.load_format, "auto: the checkpoint's weights; dummy: random weights")
      ->check(CLI::IsMember({"auto", "dummy"}));
  cmd->add_option("--dummy-seed", o->model.dummy_seed, "Seed of --load-format dummy weights");
  add_speculative_options(*cmd, o->model);
  cmd->add_option("--speculative-disable-batch-size", o->speculative_disable_batch_size,
                  "With speculation: steps of this many decoding requests or more verify no drafts (0: never off)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--speculative-adaptive", o->speculative_adaptive,
                "With speculation: verify drafts only at the batch sizes where the steps measured so far give more "
                "tokens per second speculating than not (plain steps are probed now and then)");
  cmd->add_flag("--enforce-eager", o->model.enforce_eager,
                "Launch every decode step's kernels from the host (no CUDA graphs)");
  cmd->add_flag("--no-pdl", o->model.no_pdl,
                "Launch each kernel only after the previous one finished (no programmatic dependent launch)");
  cmd->callback([o] { throw CLI::RuntimeError(run_serve(*o)); });
}

}  // namespace tern
