// Syntax tree of a parsed template: expressions and statements, each remembering its source line for errors.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "template/value.h"

namespace tern::jinja {

enum class ExprKind {
  kLiteral,    // value
  kName,       // name
  kGetAttr,    // args[0].name
  kGetItem,    // args[0][args[1]]
  kSlice,      // args[0][args[1]:args[2]:args[3]] (null parts omitted)
  kCall,       // args[0](args[1..], keywords)
  kFilter,     // args[0]|name(args[1..], keywords)
  kTest,       // args[0] is name(args[1..])
  kNot,        // not args[0]
  kNeg,        // -args[0]
  kPos,        // +args[0]
  kBinary,     // args[0] name args[1]: + - * / // % ** ~
  kAnd,        // args[0] and args[1]
  kOr,         // args[0] or args[1]
  kCompare,    // args[0] ops[0] args[1] ops[1] args[2] ...
  kCondition,  // args[1] if args[0] else args[2] (args[2] may be null)
  kList,
  kTuple,
  kDict,       // key, value, key, value...
};

struct Expr {
  ExprKind kind;
  int line = 0;
  std::string name;
  Value value;
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::string> keywords;  // for calls/filters/tests: names of the trailing keyword arguments
  std::vector<std::string> ops;       // comparison operators: == != < > <= >= in notin
  std::unique_ptr<Expr> star_args, star_kwargs;
};
using ExprPtr = std::unique_ptr<Expr>;

enum class StmtKind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kCallBlock, kFilterBlock, kWith, kBreak,
                      kContinue, kGeneration };

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

// An assignment target: a name, a namespace attribute (ns.attr) or a tuple of targets.
struct Target {
  std::string name;
  std::string attr;
  std::vector<Target> items;
  bool is_tuple = false;
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;                  // kText
  std::vector<ExprPtr> exprs;        // kOutput: [expr]; kIf: conditions; kFor: [iter, filter?]; kSet: [value];
                                     // kCallBlock: [call]; kFilterBlock: [filter chain applied to a kLiteral];
                                     // kWith: values
  std::vector<Body> bodies;          // kIf: one per condition plus else; kFor: [body, else]; others: [body]
  Target target;                     // kFor, kSet, kSetBlock
  std::vector<Target> with_targets;  // kWith
  ExprPtr filter;                    // kSetBlock: optional filter chain over a kLiteral placeholder
  std::vector<MacroParam> params;    // kMacro, kCallBlock (caller's parameters)
};

struct Program {
  Body body;
};

// Throws TemplateFailure with the line on syntax errors, unknown filters and unknown tests.
std::shared_ptr<Program> parse_program(std::string_view source);

}  // namespace tern::jinja
