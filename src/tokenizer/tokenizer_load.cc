// Tokenizer::load: reads tokenizer.json (and tokenizer_config.json / chat_template.jinja beside it) into the
// immutable tables of Tokenizer::Impl. Every error names the file and the field that is wrong.
#include <fstream>
#include <sstream>

#include "core/json_parse.h"
#include "tokenizer/json_fields.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_impl.h"

namespace tern {
namespace {

namespace fs = std::filesystem;

Expected<std::string> read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("{}: cannot open file", path.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

Expected<nlohmann::json> read_json_file(const fs::path& path) {
  TERN_ASSIGN_OR_RETURN(std::string text, read_text_file(path));
  auto doc = json_parse_untrusted(text);
  if (!doc) return make_error("{}: invalid JSON: {}", path.string(), doc.error().message);
  return doc;
}

Expected<std::vector<PostProcessStep>> post_processor_from_json(const nlohmann::json& json) {
  if (json.is_null()) return std::vector<PostProcessStep>{};
  TERN_ASSIGN_OR_RETURN(std::string type, json_type(json));
  if (type == "ByteLevel") return std::vector<PostProcessStep>{};  // changes offsets only
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    auto special = [&](const char* key) -> Expected<std::vector<int32_t>> {
      const auto it = json.find(key);
      if (it == json.end() || !it->is_array() || it->size() != 2 || !(*it)[1].is_number_integer()) {
        return make_error("{} field '{}' must be [token, id]", type, key);
      }
      return std::vector<int32_t>{(*it)[1].get<int32_t>()};
    };
    TERN_ASSIGN_OR_RETURN(auto cls, special("cls"));
    TERN_ASSIGN_OR_RETURN(auto sep, special("sep"));
    return std::vector<PostProcessStep>{PostProcessStep{cls, std::nullopt, sep}};
  }
  if (type == "TemplateProcessing") {
    const auto single = json.find("single");
    const auto specials = json.find("special_tokens");
    if (single == json.end() || !single->is_array()) return make_error("TemplateProcessing needs a 'single' list");
    PostProcessStep step;
    for (const auto& item : *single) {
      if (item.contains("Sequence")) {
        TERN_ASSIGN_OR_RETURN(std::string which, json_string(item["Sequence"], "id"));
        if (which == "A") step.push_back(std::nullopt);
        continue;
      }
      if (!item.contains("SpecialToken")) return make_error("TemplateProcessing item {} is not understood", item.dump());
      TERN_ASSIGN_OR_RETURN(std::string name, json_string(item["SpecialToken"], "id"));
      if (specials == json.end() || !specials->contains(name) || !(*specials)[name].contains("ids")) {
        return make_error("TemplateProcessing uses special token '{}' missing from special_tokens", name);
      }
      step.push_back((*specials)[name]["ids"].get<std::vector<int32_t>>());
    }
    return std::vector<PostProcessStep>{step};
  }
  if (type == "Sequence") {
    const auto list = json.find("processors");
    if (list == json.end() || !list->is_array()) return make_error("Sequence post_processor needs 'processors'");
    std::vector<PostProcessStep> steps;
    for (size_t i = 0; i < list->size(); ++i) {
      auto inner = post_processor_from_json((*list)[i]);
      if (!inner) return wrap_error(inner.error(), fmt::format("processors[{}]", i));
      steps.insert(steps.end(), inner->begin(), inner->end());
    }
    return steps;
  }
  return make_error("unsupported post_processor type '{}' (supported: TemplateProcessing, BertProcessing, "
                    "RobertaProcessing, ByteLevel, Sequence)",
                    type);
}

Expected<AddedToken> added_token_from_json(const nlohmann::json& json) {
  AddedToken token;
  TERN_ASSIGN_OR_RETURN(token.content, json_string(json, "content"));
  TERN_ASSIGN_OR_RETURN(int64_t id, json_int(json, "id", -1));
  if (id < 0 || id >= kTokenizerMaxId) {
    return make_error("added token '{}' needs a non-negative 'id' below {} (tern's limit)", token.content,
                      kTokenizerMaxId);
  }
  token.id = static_cast<int32_t>(id);
  TERN_ASSIGN_OR_RETURN(token.special, json_bool(json, "special", false));
  TERN_ASSIGN_OR_RETURN(token.single_word, json_bool(json, "single_word", false));
  TERN_ASSIGN_OR_RETURN(token.lstrip, json_bool(json, "lstrip", false));
  TERN_ASSIGN_OR_RETURN(token.rstrip, json_bool(json, "rstrip", false));
  TERN_ASSIGN_OR_RETURN(token.normalized, json_bool(json, "normalized", !token.special));
  return token;
}

// A token in tokenizer_config.json: a plain string or an AddedToken object with "content".
std::optional<std::string> config_token(const nlohmann::json& config, const char* key) {
  const auto it = config.find(key);
  if (it == config.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) return (*it)["content"].get<std::string>();
  return std::nullopt;
}

Expected<void> load_config(const fs::path& dir, Tokenizer::Impl& impl, std::vector<AddedToken>& added) {
  const fs::path config_path = dir / "tokenizer_config.json";
  if (fs::exists(config_path)) {
    TERN_ASSIGN_OR_RETURN(nlohmann::json config, read_json_file(config_path));
    impl.bos_token = config_token(config, "bos_token");
    impl.eos_token = config_token(config, "eos_token");
    if (const auto it = config.find("chat_template"); it != config.end()) {
      if (it->is_string()) impl.chat_template = it->get<std::string>();
      for (const auto& named : it->is_array() ? *it : nlohmann::json::array()) {
        if (named.value("name", "") == "default" && named.contains("template")) impl.chat_template = named["template"].get<std::string>();
      }
    }
    // Tokens declared only in the config are added as transformers does; tokenizer.json's own entries win.
    if (const auto it = config.find("added_tokens_decoder"); it != config.end() && it->is_object()) {
      for (const auto& [key, value] : it->items()) {
        nlohmann::json with_id = value;
        try {
          with_id["id"] = std::stoll(key);
        } catch (const std::exception&) {
          return make_error("{}: added_tokens_decoder key '{}' is not an id", config_path.string(), key);
        }
        auto token = added_token_from_json(with_id);
        if (!token) return wrap_error(token.error(), config_path.string() + ": added_tokens_decoder");
        const bool known = std::any_of(added.begin(), added.end(), [&](const AddedToken& t) {
          return t.id == token->id || t.content == token->content;
        });
        if (!known) added.push_back(*token);
      }
    }
  }
  if (const fs::path jinja = dir / "chat_template.jinja"; fs::exists(jinja)) {
    TERN_ASSIGN_OR_RETURN(impl.chat_template, read_text_file(jinja));
  }
  return {};
}

// See Tokenizer::max_bytes_per_token. Normalizing shrinks text at most `shrink` times; pre-tokenizers that drop
// nothing only split it or map it to longer text (ByteLevel, Metaspace); each token then covers at most `longest`
// bytes of those pieces, and an added token its content.
std::optional<size_t> text_bytes_per_token(const Tokenizer::Impl& impl,
                                          const std::vector<std::string>& normalized) {
  const size_t shrink = impl.normalizer ? impl.normalizer->shrink_factor() : 1;
  if (shrink == 0 || (impl.pre_tokenizer && impl.pre_tokenizer->drops_text())) return std::nullopt;
  std::optional<size_t> longest =
      impl.model.max_bytes_per_token(impl.pre_tokenizer && impl.pre_tokenizer->byte_level());
  if (!longest) return std::nullopt;
  for (const auto& [content, id] : impl.added_token_to_id) longest = std::max(*longest, content.size());
  for (const std::string& content : normalized) longest = std::max(*longest, content.size());
  return *longest * shrink;
}

}  // namespace

Expected<Tokenizer> Tokenizer::load(const fs::path& file_or_dir) {
  const fs::path file = fs::is_directory(file_or_dir) ? file_or_dir / "tokenizer.json" : file_or_dir;
  if (!fs::exists(file)) return make_error("{}: tokenizer file not found", file.string());
  TERN_ASSIGN_OR_RETURN(nlohmann::json json, read_json_file(file));
  if (!json.is_object()) return make_error("{}: expected a JSON object at the top level", file.string());
  auto impl = std::make_shared<Impl>();
  auto fail = [&](const Error& e, const char* field) { return wrap_error(e, fmt::format("{}: {}", file.string(), field)); };
  const auto model = json.find("model");
  if (model == json.end()) return make_error("{}: missing field 'model'", file.string());
  auto bpe = BpeModel::from_json(*model);
  if (!bpe) return fail(bpe.error(), "model");
  impl->model = std::move(*bpe);
  auto normalizer = normalizer_from_json(json.value("normalizer", nlohmann::json()));
  if (!normalizer) return fail(normalizer.error(), "normalizer");
  impl->normalizer = std::move(*normalizer);
  auto pre_tokenizer = pre_tokenizer_from_json(json.value("pre_tokenizer", nlohmann::json()));
  if (!pre_tokenizer) return fail(pre_tokenizer.error(), "pre_tokenizer");
  impl->pre_tokenizer = std::move(*pre_tokenizer);
  auto decoder = decoder_from_json(json.value("decoder", nlohmann::json()));
  if (!decoder) return fail(decoder.error(), "decoder");
  impl->decoder = std::move(*decoder);
  auto post = post_processor_from_json(json.value("post_processor", nlohmann::json()));
  if (!post) return fail(post.error(), "post_processor");
  impl->post_process = std::move(*post);

  std::vector<AddedToken> added;
  const auto added_json = json.value("added_tokens", nlohmann::json::array());
  if (!added_json.is_array()) return make_error("{}: added_tokens must be a list", file.string());
  for (size_t i = 0; i < added_json.size(); ++i) {
    auto token = added_token_from_json(added_json[i]);
    if (!token) return fail(token.error(), fmt::format("added_tokens[{}]", i).c_str());
    added.push_back(std::move(*token));
  }
  TERN_TRY(load_config(file.parent_path(), *impl, added));

  std::vector<std::string> normalized_contents;
  size_t new_contents = 0;
  for (const AddedToken& token : added) {
    std::string content = token.content;
    if (token.normalized && impl->normalizer) impl->normalizer->normalize(content);
    normalized_contents.push_back(std::move(content));
    impl->added_id_to_token.emplace(token.id, token.content);
    const bool fresh = impl->added_token_to_id.emplace(token.content, token.id).second;
    if (fresh && !impl->model.token_to_id(token.content)) ++new_contents;
    if (token.special) impl->special_contents.insert(token.content);
  }
  impl->vocab_size = impl->model.vocab().size() + new_contents;
  impl->max_bytes_per_token = text_bytes_per_token(*impl, normalized_contents);
  impl->added = AddedVocabulary(std::move(added), normalized_contents);
  Tokenizer tokenizer;
  tokenizer.impl_ = std::move(impl);
  return tokenizer;
}

}  // namespace tern
