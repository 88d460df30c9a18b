#include "cli/perplexity_command.h"

#include <fmt/format.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/model_options.h"
#include "io/model_config.h"
#include "runtime/perplexity.h"
#include "tokenizer/tokenizer.h"

namespace tern {
namespace {

struct PerplexityCliOptions {
  ModelCliOptions model;
  std::string text_file;
  // Parsed here rather than by CLI11, so that a value that is not an integer is bad input (exit 2) like any other.
  std::string context = "512";
  std::string stride;  // empty: context / 2
  std::string kl_reference;
  bool json = false;
};

constexpr int kBadInput = 2;   // what the user gave cannot be scored
constexpr int kRunFailed = 1;  // a window's logits were not finite, or the model failed while running

int fail(int code, const std::string& message) {
  fmt::print(stderr, "tern perplexity: {}\n", message);
  return code;
}

// The file's bytes, as they are (UTF-8 text; no newline translation).
Expected<std::string> read_text_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return make_error("--text-file '{}' does not exist", path);
  if (!std::filesystem::is_regular_file(path, ec)) return make_error("--text-file '{}' is not a regular file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("cannot read --text-file '{}'", path);
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return make_error("cannot read --text-file '{}'", path);
  return text.str();
}

Expected<Tokenizer> load_tokenizer(const std::string& model_dir, const char* flag) {
  std::error_code ec;
  if (!std::filesystem::is_directory(model_dir, ec)) return make_error("{} '{}' is not a directory", flag, model_dir);
  if (!std::filesystem::exists(std::filesystem::path(model_dir) / "tokenizer.json")) {
    return make_error("{} '{}' has no tokenizer.json: perplexity needs the model's tokenizer to encode the text", flag,
                      model_dir);
  }
  return Tokenizer::load(model_dir);
}

// A window of `model`'s logits, from a fresh sequence.
WindowLogits window_logits_of(ModelRunner& model, std::span<const int32_t> tokens) {
  return [&model, tokens](int64_t begin, int64_t end) -> Expected<std::vector<float>> {
    SequenceCache seq = model.new_sequence();
    const std::vector<SequenceInput> batch{
        {&seq, tokens.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin))}};
    return model.forward(batch, LogitsFor::kAllTokens);
  };
}

// Doubles in JSON with 17 significant digits (enough to read back the same double); null where not finite.
std::string json_double(double x) {
  return std::isfinite(x) ? fmt::format("{:.17g}", x) : "null";
}
std::string json_string(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void print_json(const PerplexityCliOptions& o, int64_t context, int64_t stride, const PerplexityResult& r) {
  std::string out = "{";
  out += fmt::format("\"model\": {}, \"text_file\": {}, ", json_string(o.model.model_dir), json_string(o.text_file));
  out += fmt::format("\"tokens\": {}, \"scored\": {}, \"windows\": {}, \"context\": {}, \"stride\": {}, ", r.tokens,
                     r.scored, r.windows, context, stride);
  out += fmt::format("\"mean_nll\": {}, \"perplexity\": {}", json_double(r.mean_nll), json_double(r.perplexity));
  if (r.has_reference) {
    out += fmt::format(", \"kl_reference\": {}, \"reference_mean_nll\": {}, \"reference_perplexity\": {}",
                       json_string(o.kl_reference), json_double(r.reference_mean_nll),
                       json_double(r.reference_perplexity));
    out += fmt::format(", \"kl\": {{\"mean\": {}, \"max\": {}, \"p99\": {}}}, \"top1_agreement\": {}",
                       json_double(r.kl.mean), json_double(r.kl.max), json_double(r.kl.p99),
                       json_double(r.top1_agreement));
  }
  out += "}";
  fmt::print("{}\n", out);
}

void print_text(const PerplexityCliOptions& o, int64_t context, int64_t stride, const PerplexityResult& r) {
  fmt::print("model: {}\n", o.model.model_dir);
  fmt::print("text: {}: {} tokens, {} scored\n", o.text_file, r.tokens, r.scored);
  fmt::print("windows: {} of context {}, stride {}\n", r.windows, context, stride);
  fmt::print("mean NLL: {:.6f}\n", r.mean_nll);
  fmt::print("perplexity: {:.4f}\n", r.perplexity);
  if (r.has_reference) {
    fmt::print("reference: {}: mean NLL {:.6f}, perplexity {:.4f}\n", o.kl_reference, r.reference_mean_nll,
               r.reference_perplexity);
    fmt::print("KL(reference || model): mean {:.6g}, max {:.6g}, p99 {:.6g}\n", r.kl.mean, r.kl.max, r.kl.p99);
    fmt::print("top-1 agreement: {:.6f} ({} of {})\n", r.top1_agreement, r.top1_matches, r.scored);
  }
}

// What the protocol needs of a model directory before its weights are loaded: the tokens of the text under its
// tokenizer, and a context within its positions.
struct Checked {
  std::vector<int32_t> tokens;
  ModelConfig config;
  size_t tokenizer_vocab = 0;
};

Expected<Checked> check_model_dir(const std::string& dir, const char* flag, const std::string& text, int64_t context) {
  Checked c;
  TERN_ASSIGN_OR_RETURN(Tokenizer tokenizer, load_tokenizer(dir, flag));
  c.tokens = tokenizer.encode(text, /*add_special_tokens=*/false);
  c.tokenizer_vocab = tokenizer.vocab_size();
  TERN_ASSIGN_OR_RETURN(c.config, model_config_load(dir));
  if (c.config.max_position_embeddings > 0 && context > c.config.max_position_embeddings) {
    return make_error("--context {} exceeds the max_position_embeddings ({}) of {} '{}'", context,
                      c.config.max_position_embeddings, flag, dir);
  }
  return c;
}

Expected<int64_t> parse_count(const std::string& flag, const std::string& text) {
  int64_t value = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size()) {
    return make_error("{} '{}' is not an integer", flag, text);
  }
  return value;
}

int run_perplexity(const PerplexityCliOptions& o) {
  auto context_value = parse_count("--context", o.context);
  if (!context_value) return fail(kBadInput, context_value.error().message);
  const int64_t context = *context_value;
  if (context < 2) return fail(kBadInput, fmt::format("--context must be at least 2, got {}", context));
  auto stride_value = o.stride.empty() ? Expected<int64_t>(context / 2) : parse_count("--stride", o.stride);
  if (!stride_value) return fail(kBadInput, stride_value.error().message);
  const int64_t stride = *stride_value;
  if (stride < 1 || stride > context) {
    return fail(kBadInput, fmt::format("--stride must be between 1 and --context ({}), got {}", context, stride));
  }
  auto text = read_text_file(o.text_file);
  if (!text) return fail(kBadInput, text.error().message);
  if (text->empty()) return fail(kBadInput, fmt::format("--text-file '{}' is empty", o.text_file));

  auto model_dir = check_model_dir(o.model.model_dir, "--model", *text, context);
  if (!model_dir) return fail(kBadInput, model_dir.error().message);
  const std::vector<int32_t>& tokens = model_dir->tokens;
  if (tokens.size() < 2) {
    return fail(kBadInput, fmt::format("--text-file '{}' encodes to {} token(s); perplexity needs at least 2",
                                       o.text_file, tokens.size()));
  }
  std::optional<Checked> reference_dir;
  if (!o.kl_reference.empty()) {
    auto checked = check_model_dir(o.kl_reference, "--kl-reference", *text, context);
    if (!checked) return fail(kBadInput, checked.error().message);
    reference_dir.emplace(std::move(*checked));
    const int64_t v = model_dir->config.vocab_size, rv = reference_dir->config.vocab_size;
    if (v != rv) {
      return fail(kBadInput, fmt::format("--kl-reference: the vocabularies differ: --model '{}' has vocab_size {}, "
                                         "--kl-reference '{}' has {}",
                                         o.model.model_dir, v, o.kl_reference, rv));
    }
    const size_t tv = model_dir->tokenizer_vocab, rtv = reference_dir->tokenizer_vocab;
    if (tv != rtv) {
      return fail(kBadInput, fmt::format("--kl-reference: the tokenizer vocabularies differ: --model '{}' has {} "
                                         "tokens, --kl-reference '{}' has {}",
                                         o.model.model_dir, tv, o.kl_reference, rtv));
    }
    const std::vector<int32_t>& rt = reference_dir->tokens;
    if (rt != tokens) {
      size_t at = 0;
      while (at < tokens.size() && at < rt.size() && tokens[at] == rt[at]) ++at;
      return fail(kBadInput, fmt::format("--kl-reference: the tokenizer of '{}' encodes '{}' to other tokens than "
                                         "that of '{}' ({} against {} tokens, first difference at position {})",
                                         o.kl_reference, o.text_file, o.model.model_dir, rt.size(), tokens.size(), at));
    }
  }

  const DeviceModelOptions sizes{.max_batch_tokens = context, .max_sequences = 1, .kv_cache_tokens = context};
  auto model = load_model_from_options(o.model, sizes);
  if (!model) return fail(kBadInput, model.error().message);
  std::unique_ptr<ModelRunner> reference;
  if (reference_dir) {
    ModelCliOptions ref_options = o.model;
    ref_options.model_dir = o.kl_reference;
    // Rank processes repeat this command line, which loads the model under test: the reference's ranks are threads.
    ref_options.distributed_executor_backend = "threads";
    auto loaded = load_model_from_options(ref_options, sizes);
    if (!loaded) return fail(kBadInput, fmt::format("--kl-reference: {}", loaded.error().message));
    reference = std::move(*loaded);
  }

  PerplexityOptions options{.context = context, .stride = stride, .vocab = (*model)->config().vocab_size};
  const bool progress = isatty(fileno(stderr)) != 0;
  if (progress) {
    options.progress = [](size_t window, size_t windows) {
      fmt::print(stderr, "\rwindow {}/{}{}", window + 1, windows, window + 1 == windows ? "\n" : "");
    };
  }
  const WindowLogits of_model = window_logits_of(**model, tokens);
  WindowLogits of_reference;
  if (reference) of_reference = window_logits_of(*reference, tokens);
  auto result = perplexity_run(tokens, options, of_model, reference ? &of_reference : nullptr);
  if (!result) {
    if (progress) fmt::print(stderr, "\n");
    return fail(result.error().kind == PerplexityFailure::kBadInput ? kBadInput : kRunFailed, result.error().message);
  }
  if (o.json) {
    print_json(o, context, stride, *result);
  } else {
    print_text(o, context, stride, *result);
  }
  return 0;
}

}  // namespace

void register_perplexity_command(CLI::App& app) {
  auto o = std::make_shared<PerplexityCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "perplexity", "Perplexity of a text file over strided sliding windows (and KL against a reference model)");
  add_model_options(*cmd, o->model);
  cmd->add_option("--text-file", o->text_file, "UTF-8 text to score (encoded whole, no special tokens)")->required();
  cmd->add_option("--context", o->context, "Tokens per window (at most the model's max_position_embeddings)")
      ->capture_default_str();
  cmd->add_option("--stride", o->stride, "Tokens between window starts, 1..context (default context/2)");
  cmd->add_option("--kl-reference", o->kl_reference,
                  "Reference model directory (same tokenizer): KL(reference || model), top-1 agreement and its own "
                  "perplexity, on the same windows");
  cmd->add_flag("--json", o->json, "Print one JSON object");
  cmd->callback([o] { throw CLI::RuntimeError(run_perplexity(*o)); });
}

}  // namespace tern
