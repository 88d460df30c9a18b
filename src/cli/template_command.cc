#include "cli/template_command.h"

#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "template/model_template.h"

namespace tern {
namespace {

using json = nlohmann::ordered_json;

struct TemplateOptions {
  std::string model_dir;
  std::string template_file;
  std::string input_jsonl;
  std::string messages_file;
  std::string tools_file;
  std::vector<std::string> sets;
};

Expected<json> read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return make_error("{}: cannot open file", path);
  json j = json::parse(in, nullptr, false);
  if (j.is_discarded()) return make_error("{}: not valid JSON", path);
  return j;
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Renders each line of the input file; one {"text"} or {"error"} line out per input line.
int render_jsonl(const ChatTemplateSet& templates, const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    std::cerr << "error: " << path << ": cannot open file\n";
    return 1;
  }
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json request = json::parse(line, nullptr, false);
    json out = json::object();
    if (request.is_discarded()) {
      out["error"] = fmt::format("{}:{}: not valid JSON", path, line_no);
    } else if (auto text = templates.render_request(request)) {
      out["text"] = *text;
    } else {
      out["error"] = text.error().message;
    }
    std::cout << dump(out) << '\n';
  }
  return 0;
}

// --set key=value: the value is JSON when it parses as JSON (true, 3, "x", [..]), else the raw string.
Expected<void> apply_sets(json& request, const std::vector<std::string>& sets) {
  for (const std::string& s : sets) {
    const size_t eq = s.find('=');
    if (eq == std::string::npos || eq == 0) return make_error("--set '{}': expected key=value", s);
    json value = json::parse(s.substr(eq + 1), nullptr, false);
    request[s.substr(0, eq)] = value.is_discarded() ? json(s.substr(eq + 1)) : value;
  }
  return {};
}

int render_single(const ChatTemplateSet& templates, const TemplateOptions& o) {
  json request = json::object();
  auto messages = read_json_file(o.messages_file);
  if (!messages) {
    std::cerr << "error: " << messages.error().message << '\n';
    return 1;
  }
  request["messages"] = *messages;
  if (!o.tools_file.empty()) {
    auto tools = read_json_file(o.tools_file);
    if (!tools) {
      std::cerr << "error: " << tools.error().message << '\n';
      return 1;
    }
    request["tools"] = *tools;
  }
  if (auto ok = apply_sets(request, o.sets); !ok) {
    std::cerr << "error: " << ok.error().message << '\n';
    return 1;
  }
  auto text = templates.render_request(request);
  if (!text) {
    std::cerr << "error: " << text.error().message << '\n';
    return 1;
  }
  std::cout << *text;
  return 0;
}

int run_template_command(const TemplateOptions& o) {
  auto templates = o.model_dir.empty() ? chat_templates_load_file(o.template_file) : chat_templates_load_model(o.model_dir);
  if (!templates) {
    std::cerr << "error: " << templates.error().message << '\n';
    return 1;
  }
  if (!o.input_jsonl.empty()) return render_jsonl(*templates, o.input_jsonl);
  if (o.messages_file.empty()) {
    std::cerr << "error: give --input-jsonl FILE or --messages FILE.json\n";
    return 1;
  }
  return render_single(*templates, o);
}

}  // namespace

void register_template_command(CLI::App& app) {
  auto opts = std::make_shared<TemplateOptions>();
  CLI::App* cmd = app.add_subcommand("template", "Render chat messages with a model's chat template");
  auto* model = cmd->add_option("--model", opts->model_dir, "Model directory (chat_template.jinja or tokenizer_config.json)");
  auto* file = cmd->add_option("--template", opts->template_file, "A chat template file (.jinja)");
  model->excludes(file);
  file->excludes(model);
  cmd->add_option("--input-jsonl", opts->input_jsonl,
                  "One request object per line ({messages, tools?, add_generation_prompt?, ...}); "
                  "writes one {\"text\"} or {\"error\"} line each");
  auto* messages = cmd->add_option("--messages", opts->messages_file, "A JSON file with the messages array");
  cmd->add_option("--tools", opts->tools_file, "A JSON file with the tools array")->needs(messages);
  cmd->add_option("--set", opts->sets, "key=value template variable (value parsed as JSON when possible)")->needs(messages);
  cmd->callback([opts, model, file]() {
    if (model->count() == 0 && file->count() == 0) throw CLI::RequiredError("--model or --template");
    if (const int rc = run_template_command(*opts); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace tern
