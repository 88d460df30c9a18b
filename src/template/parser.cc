// Recursive-descent parser following Jinja2's grammar and operator precedence (parser.py): or < and < not <
// comparisons < + - < ~ < * / // % < ** (left-associative) < unary < postfix, filters and tests.
#include <fmt/format.h>

#include <initializer_list>

#include "template/ast.h"
#include "template/builtins.h"
#include "template/lexer.h"

namespace tern::jinja {
namespace {

std::string describe(const Token& t) {
  switch (t.type) {
    case TokenType::kEof: return "end of template";
    case TokenType::kBlockEnd: return "end of statement block";
    case TokenType::kVariableEnd: return "end of print statement";
    case TokenType::kBlockBegin: return "begin of statement block";
    case TokenType::kVariableBegin: return "begin of print statement";
    case TokenType::kData: return "template data";
    default: return t.value;
  }
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  std::shared_ptr<Program> run() {
    auto program = std::make_shared<Program>();
    program->body = subparse({});
    if (cur().type != TokenType::kEof) error(fmt::format("unexpected '{}'", describe(cur())));
    return program;
  }

 private:
  const Token& cur() const { return tokens_[pos_]; }
  const Token& look() const { return tokens_[std::min(pos_ + 1, tokens_.size() - 1)]; }
  const Token& next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  bool is_op(std::string_view op) const { return cur().type == TokenType::kOperator && cur().value == op; }
  bool is_name(std::string_view n) const { return cur().type == TokenType::kName && cur().value == n; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  [[noreturn]] void error(const std::string& message) const { throw TemplateFailure(message, cur().line); }

  // Nesting of blocks and expressions, bounded so that a hostile template (20,000 parentheses, `not`s or nested
  // ifs) is an error rather than a stack overflow here or in the renderer. Real templates nest a few levels; Python
  // Jinja2 stops at Python's recursion limit (1000 frames, a few per level).
  static constexpr int kMaxNesting = 400;
  class Nested {
   public:
    explicit Nested(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxNesting) {
        p_.error(fmt::format("the template nests blocks or expressions deeper than {} levels (tern's limit)",
                             kMaxNesting));
      }
    }
    ~Nested() { --p_.depth_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;

   private:
    Parser& p_;
  };
  int depth_ = 0;
  void expect_op(std::string_view op) {
    if (!skip_op(op)) error(fmt::format("expected token '{}', got '{}'", op, describe(cur())));
  }
  std::string expect_name() {
    if (cur().type != TokenType::kName) error(fmt::format("expected token 'name', got '{}'", describe(cur())));
    return next().value;
  }
  void expect_type(TokenType type, const char* what) {
    if (cur().type != type) error(fmt::format("expected token '{}', got '{}'", what, describe(cur())));
    next();
  }
  void expect_block_end() { expect_type(TokenType::kBlockEnd, "end of statement block"); }

  ExprPtr make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // --- statements ---

  Body subparse(std::initializer_list<std::string_view> end_tags) {
    Body body;
    while (cur().type != TokenType::kEof) {
      const Token& t = cur();
      if (t.type == TokenType::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kText;
        s->line = t.line;
        s->text = t.value;
        body.push_back(std::move(s));
        next();
      } else if (t.type == TokenType::kVariableBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->line = cur().line;
        s->exprs.push_back(parse_tuple(false, true, {}, false));
        expect_type(TokenType::kVariableEnd, "end of print statement");
        body.push_back(std::move(s));
      } else if (t.type == TokenType::kBlockBegin) {
        next();
        for (std::string_view tag : end_tags)
          if (is_name(tag)) return body;
        body.push_back(parse_statement(end_tags));
        expect_block_end();
      } else {
        error(fmt::format("unexpected '{}'", describe(t)));
      }
    }
    if (end_tags.size() > 0) {
      std::string names;
      for (std::string_view tag : end_tags) names += (names.empty() ? "'" : " or '") + std::string(tag) + "'";
      error(fmt::format("Unexpected end of template. Jinja was looking for the following tags: {}.", names));
    }
    return body;
  }

  // Body up to one of `end_tags`; the end tag name stays current unless dropped.
  Body parse_statements(std::initializer_list<std::string_view> end_tags, bool drop_needle) {
    skip_op(":");
    expect_block_end();
    Body body = subparse(end_tags);
    if (drop_needle) next();
    return body;
  }

  std::unique_ptr<Stmt> new_stmt(StmtKind kind, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  std::unique_ptr<Stmt> parse_statement(std::initializer_list<std::string_view> outer_end_tags) {
    const Nested nested(*this);
    if (cur().type != TokenType::kName) error("tag name expected");
    const int line = cur().line;
    const std::string tag = cur().value;
    if (tag == "if") return parse_if();
    if (tag == "for") return parse_for();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "call") return parse_call_block();
    if (tag == "filter") return parse_filter_block();
    if (tag == "with") return parse_with();
    if (tag == "generation") {
      next();
      auto s = new_stmt(StmtKind::kGeneration, line);
      s->bodies.push_back(parse_statements({"endgeneration"}, true));
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) error(fmt::format("'{}' outside of a loop", tag));
      next();
      return new_stmt(tag == "break" ? StmtKind::kBreak : StmtKind::kContinue, line);
    }
    std::string message = fmt::format("Encountered unknown tag '{}'.", tag);
    if (outer_end_tags.size() > 0) {
      std::string names;
      for (std::string_view t : outer_end_tags) names += (names.empty() ? "'" : " or '") + std::string(t) + "'";
      message += fmt::format(" Jinja was looking for the following tags: {}.", names);
    }
    error(message);
  }

  std::unique_ptr<Stmt> parse_if() {
    auto s = new_stmt(StmtKind::kIf, cur().line);
    next();
    while (true) {
      s->exprs.push_back(parse_tuple(false, false, {}, false));
      s->bodies.push_back(parse_statements({"elif", "else", "endif"}, false));
      const std::string tag = next().value;
      if (tag == "elif") continue;
      if (tag == "else") s->bodies.push_back(parse_statements({"endif"}, true));
      break;
    }
    return s;
  }

  std::unique_ptr<Stmt> parse_for() {
    auto s = new_stmt(StmtKind::kFor, cur().line);
    next();
    s->target = parse_assign_target(false, {"in"});
    if (!skip_name("in")) error(fmt::format("expected token 'in', got '{}'", describe(cur())));
    s->exprs.push_back(parse_tuple(false, false, {"recursive"}, false));
    if (skip_name("if")) s->exprs.push_back(parse_expression(true));
    if (is_name("recursive")) error("recursive loops are not supported");
    ++loop_depth_;
    s->bodies.push_back(parse_statements({"endfor", "else"}, false));
    --loop_depth_;
    if (next().value == "endfor") {
      s->bodies.emplace_back();
    } else {
      s->bodies.push_back(parse_statements({"endfor"}, true));
    }
    return s;
  }

  std::unique_ptr<Stmt> parse_set() {
    const int line = cur().line;
    next();
    Target target = parse_assign_target(true, {});
    if (skip_op("=")) {
      auto s = new_stmt(StmtKind::kSet, line);
      s->target = std::move(target);
      s->exprs.push_back(parse_tuple(false, true, {}, false));
      return s;
    }
    auto s = new_stmt(StmtKind::kSetBlock, line);
    if (!target.attr.empty() || target.is_tuple) error("expected token '=', got '" + describe(cur()) + "'");
    s->target = std::move(target);
    if (is_op("|")) s->filter = parse_filter_chain(body_placeholder(line), false);
    s->bodies.push_back(parse_statements({"endset"}, true));
    return s;
  }

  ExprPtr body_placeholder(int line) {
    auto e = make(ExprKind::kName, line);
    e->name = kBodyVariable;
    return e;
  }

  void parse_signature(std::vector<MacroParam>& params) {
    expect_op("(");
    while (!is_op(")")) {
      if (!params.empty()) expect_op(",");
      MacroParam p;
      p.name = expect_name();
      if (skip_op("=")) p.default_value = parse_expression(true);
      else if (!params.empty() && params.back().default_value) error("non-default argument follows default argument");
      params.push_back(std::move(p));
    }
    expect_op(")");
  }

  std::unique_ptr<Stmt> parse_macro() {
    auto s = new_stmt(StmtKind::kMacro, cur().line);
    next();
    s->target.name = expect_name();
    parse_signature(s->params);
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->bodies.push_back(parse_statements({"endmacro"}, true));
    loop_depth_ = saved;
    return s;
  }

  std::unique_ptr<Stmt> parse_call_block() {
    auto s = new_stmt(StmtKind::kCallBlock, cur().line);
    next();
    if (is_op("(")) parse_signature(s->params);
    ExprPtr call = parse_expression(true);
    if (call->kind != ExprKind::kCall) error("expected call");
    s->exprs.push_back(std::move(call));
    s->bodies.push_back(parse_statements({"endcall"}, true));
    return s;
  }

  std::unique_ptr<Stmt> parse_filter_block() {
    auto s = new_stmt(StmtKind::kFilterBlock, cur().line);
    next();
    s->filter = parse_filter_chain(body_placeholder(s->line), true);
    s->bodies.push_back(parse_statements({"endfilter"}, true));
    return s;
  }

  std::unique_ptr<Stmt> parse_with() {
    auto s = new_stmt(StmtKind::kWith, cur().line);
    next();
    while (cur().type != TokenType::kBlockEnd) {
      if (!s->with_targets.empty()) expect_op(",");
      s->with_targets.push_back(parse_assign_target(false, {}));
      expect_op("=");
      s->exprs.push_back(parse_expression(true));
    }
    s->bodies.push_back(parse_statements({"endwith"}, true));
    return s;
  }

  Target parse_assign_target(bool with_namespace, std::initializer_list<std::string_view> extra_end) {
    if (with_namespace && cur().type == TokenType::kName && look().type == TokenType::kOperator && look().value == ".") {
      Target t;
      t.name = next().value;
      next();
      t.attr = expect_name();
      return t;
    }
    ExprPtr e = parse_tuple(true, true, extra_end, false);
    return to_target(*e);
  }

  Target to_target(const Expr& e) {
    Target t;
    if (e.kind == ExprKind::kName) {
      static constexpr const char* kReserved[] = {"true", "false", "none", "True", "False", "None"};
      for (const char* r : kReserved)
        if (e.name == r) error(fmt::format("Can't assign to {}", e.name));
      t.name = e.name;
      return t;
    }
    if (e.kind != ExprKind::kTuple) error("Can't assign to this expression");
    t.is_tuple = true;
    for (const auto& item : e.args) t.items.push_back(to_target(*item));
    return t;
  }

  // --- expressions ---

  bool is_tuple_end(std::initializer_list<std::string_view> extra_end) const {
    const TokenType t = cur().type;
    if (t == TokenType::kVariableEnd || t == TokenType::kBlockEnd || t == TokenType::kEof || is_op(")")) return true;
    for (std::string_view n : extra_end)
      if (is_name(n)) return true;
    return false;
  }

  ExprPtr parse_tuple(bool simplified, bool with_condexpr, std::initializer_list<std::string_view> extra_end,
                      bool explicit_parentheses) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end(extra_end)) break;
      items.push_back(simplified ? parse_primary() : parse_expression(with_condexpr));
      if (is_op(",")) is_tuple = true;
      else break;
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parentheses) error(fmt::format("Expected an expression, got '{}'", describe(cur())));
    }
    auto e = make(ExprKind::kTuple, line);
    e->args = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    if (!with_condexpr) return parse_or();
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      const int line = cur().line;
      next();
      auto cond = make(ExprKind::kCondition, line);
      cond->args.push_back(parse_or());
      cond->args.push_back(std::move(expr));
      cond->args.push_back(skip_name("else") ? parse_expression(true) : nullptr);
      expr = std::move(cond);
    }
    return expr;
  }

  ExprPtr binary(ExprKind kind, ExprPtr a, ExprPtr b, int line, std::string op = {}) {
    auto e = make(kind, line);
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const int line = next().line;
      left = binary(ExprKind::kOr, std::move(left), parse_and(), line);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const int line = next().line;
      left = binary(ExprKind::kAnd, std::move(left), parse_not(), line);
    }
    return left;
  }

  ExprPtr parse_not() {
    const Nested nested(*this);
    if (is_name("not")) {
      auto e = make(ExprKind::kNot, next().line);
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == TokenType::kOperator &&
          (cur().value == "==" || cur().value == "!=" || cur().value == "<" || cur().value == ">" ||
           cur().value == "<=" || cur().value == ">=")) {
        op = next().value;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && look().type == TokenType::kName && look().value == "in") {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(ExprKind::kCompare, line);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      left = binary(ExprKind::kBinary, std::move(left), parse_concat(), t.line, t.value);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      const int line = next().line;
      left = binary(ExprKind::kBinary, std::move(left), parse_math2(), line, "~");
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      left = binary(ExprKind::kBinary, std::move(left), parse_pow(), t.line, t.value);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const int line = next().line;
      left = binary(ExprKind::kBinary, std::move(left), parse_unary(true), line, "**");
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    const Nested nested(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      node = make(t.value == "-" ? ExprKind::kNeg : ExprKind::kPos, t.line);
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    const int line = t.line;
    switch (t.type) {
      case TokenType::kName: {
        next();
        if (t.value == "true" || t.value == "True") return literal(Value::boolean(true), line);
        if (t.value == "false" || t.value == "False") return literal(Value::boolean(false), line);
        if (t.value == "none" || t.value == "None") return literal(Value::none(), line);
        auto e = make(ExprKind::kName, line);
        e->name = t.value;
        return e;
      }
      case TokenType::kString: {
        std::string s = next().value;
        while (cur().type == TokenType::kString) s += next().value;
        return literal(Value::string(std::move(s)), line);
      }
      case TokenType::kInteger: return literal(Value::integer(next().int_value), line);
      case TokenType::kFloat: return literal(Value::number(next().float_value), line);
      default: break;
    }
    if (skip_op("(")) {
      ExprPtr e = parse_tuple(false, true, {}, true);
      expect_op(")");
      return e;
    }
    if (skip_op("[")) {
      auto e = make(ExprKind::kList, line);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (skip_op("{")) {
      auto e = make(ExprKind::kDict, line);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      expect_op("}");
      return e;
    }
    error(fmt::format("unexpected '{}'", describe(t)));
  }

  ExprPtr literal(Value v, int line) {
    auto e = make(ExprKind::kLiteral, line);
    e->value = std::move(v);
    return e;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) node = parse_subscript(std::move(node));
      else if (is_op("(")) node = parse_call(std::move(node));
      else return node;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) node = parse_filter_chain(std::move(node), false);
      else if (is_name("is")) node = parse_test(std::move(node));
      else if (is_op("(")) node = parse_call(std::move(node));
      else return node;
    }
  }

  ExprPtr parse_subscript(ExprPtr node) {
    const Token& t = next();
    if (t.value == ".") {
      const Token& attr = next();
      if (attr.type == TokenType::kName) {
        auto e = make(ExprKind::kGetAttr, t.line);
        e->name = attr.value;
        e->args.push_back(std::move(node));
        return e;
      }
      if (attr.type != TokenType::kInteger) error("expected name or number");
      auto e = make(ExprKind::kGetItem, t.line);
      e->args.push_back(std::move(node));
      e->args.push_back(literal(Value::integer(attr.int_value), t.line));
      return e;
    }
    std::vector<ExprPtr> subs;
    while (!is_op("]")) {
      if (!subs.empty()) expect_op(",");
      subs.push_back(parse_subscribed());
    }
    expect_op("]");
    if (subs.size() == 1 && subs[0]->kind == ExprKind::kSlice) {
      subs[0]->args[0] = std::move(node);
      return std::move(subs[0]);
    }
    for (const ExprPtr& s : subs) {
      // Python would build a tuple of slice objects, which no list, string or dict accepts as an index.
      if (s->kind == ExprKind::kSlice) error("a slice cannot be one of several subscripts");
    }
    auto e = make(ExprKind::kGetItem, t.line);
    e->args.push_back(std::move(node));
    if (subs.size() == 1) {
      e->args.push_back(std::move(subs[0]));
    } else {
      auto tuple = make(ExprKind::kTuple, t.line);
      tuple->args = std::move(subs);
      e->args.push_back(std::move(tuple));
    }
    return e;
  }

  // One subscript: an expression or a slice a:b:c (a kSlice whose args[0] is filled in by the caller).
  ExprPtr parse_subscribed() {
    const int line = cur().line;
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) return start;
    }
    next();
    auto e = make(ExprKind::kSlice, line);
    e->args.push_back(nullptr);
    e->args.push_back(std::move(start));
    e->args.push_back(is_op("]") || is_op(",") || is_op(":") ? nullptr : parse_expression(true));
    ExprPtr step;
    if (skip_op(":") && !is_op("]") && !is_op(",")) step = parse_expression(true);
    e->args.push_back(std::move(step));
    return e;
  }

  // Fills args (after those already there) and keywords from "(...)".
  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) {
        expect_op(",");
        if (is_op(")")) break;
      }
      first = false;
      if (skip_op("*")) {
        e.star_args = parse_expression(true);
      } else if (skip_op("**")) {
        e.star_kwargs = parse_expression(true);
      } else if (cur().type == TokenType::kName && look().type == TokenType::kOperator && look().value == "=") {
        e.keywords.push_back(next().value);
        next();
        e.args.push_back(parse_expression(true));
      } else {
        if (!e.keywords.empty() || e.star_args || e.star_kwargs) error("Invalid argument syntax");
        e.args.push_back(parse_expression(true));
      }
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr node) {
    auto e = make(ExprKind::kCall, cur().line);
    e->args.push_back(std::move(node));
    parse_call_args(*e);
    return e;
  }

  std::string parse_dotted_name() {
    std::string name = expect_name();
    while (skip_op(".")) name += "." + expect_name();
    return name;
  }

  ExprPtr parse_filter_chain(ExprPtr node, bool start_inline) {
    while (is_op("|") || start_inline) {
      if (!start_inline) next();
      start_inline = false;
      const int line = cur().line;
      auto e = make(ExprKind::kFilter, line);
      e->name = parse_dotted_name();
      if (!builtin_has_filter(e->name)) error(fmt::format("No filter named '{}'.", e->name));
      e->args.push_back(std::move(node));
      if (is_op("(")) parse_call_args(*e);
      node = std::move(e);
    }
    return node;
  }

  ExprPtr parse_test(ExprPtr node) {
    const int line = next().line;  // "is"
    const bool negated = skip_name("not");
    auto e = make(ExprKind::kTest, line);
    e->name = parse_dotted_name();
    if (!builtin_has_test(e->name)) error(fmt::format("No test named '{}'.", e->name));
    e->args.push_back(std::move(node));
    const TokenType t = cur().type;
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((t == TokenType::kName || t == TokenType::kString || t == TokenType::kInteger ||
                t == TokenType::kFloat || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) error("You cannot chain multiple tests with is");
      e->args.push_back(parse_postfix(parse_primary()));
    }
    if (!negated) return e;
    auto n = make(ExprKind::kNot, line);
    n->args.push_back(std::move(e));
    return n;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

std::shared_ptr<Program> parse_program(std::string_view source) { return Parser(lex_template(source)).run(); }

}  // namespace tern::jinja
