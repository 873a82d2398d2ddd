// command_line: a program's options and arguments, declared once in a table;
// the parsing, the --help text and the errors come from that table. For
// dcomm's own programs (dcomm-run, dcomm-trace, the examples, the
// benchmarks) and for users' programs alike: the standard library is all it
// needs.
//
//   int world = 0;
//   std::size_t max_bytes = 1 << 20;
//   bool check = true;
//   std::string redop = "sum";
//   dcomm::command_line cl("bench", "Times all_reduce.");
//   cl.option("world", world, "N", "spawn N local ranks; 0: one rank of a launched job")
//       .at_least(0);
//   cl.bytes("max-bytes", max_bytes, "B", "the largest message: 8, 4K, 64M, 1G");
//   cl.option("redop", redop, "OP", "sum, min or max").one_of({"sum", "min", "max"});
//   cl.flag("no-check", check, "leave the results unchecked", false);
//   cl.parse(argc, argv);
//
// parse() prints the table for -h/--help (exit 0), and for a bad command line
// says what is wrong, "bench: --world needs an integer >= 0, not 'two'", and
// exits with 2. try_parse() throws usage_error instead (and returns false for
// --help), for tests and programs that want to go on.
//
// What it reads: --name VALUE and --name=VALUE; one-letter names as -n VALUE
// and -nVALUE, flags clustered (-ab); a unique prefix of a long name (--nproc
// for --nproc-per-node), as getopt_long and argparse read them; "--" ends the
// options. Positional arguments come anywhere, or, after
// stop_at_first_argument(), end the options: a launcher's PROGRAM ARGS... are
// the program's own, options included. Values: integers (the whole text, in
// the target's range and the bounds given), finite numbers, text (not
// empty), byte sizes, one of a list (mapped to the target's values by
// choice()), or a reader of the program's own (custom()).
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace dcomm {

// What is wrong with a command line, for its user. A value reader's
// message says what the value should be ("needs an integer >= 1, not 'x'")
// without a name: the parser puts the option's in front (a program reading
// an environment variable puts the variable's).
class usage_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class command_line {
  struct entry;

 public:
  // What option() and its kin return: the entry just declared, for bounds
  // and lists.
  class declared {
   public:
    // Numbers: the smallest and the largest value taken.
    declared& at_least(double low) {
      e_->low = low;
      return *this;
    }
    declared& at_most(double high) {
      e_->high = high;
      return *this;
    }
    // Text: the values taken (help and errors list them).
    declared& one_of(std::vector<std::string> values) {
      e_->choices = std::move(values);
      return *this;
    }
    // Positional arguments: whether one must be given.
    declared& optional() {
      e_->required = false;
      return *this;
    }
    declared& required() {
      e_->required = true;
      return *this;
    }

   private:
    friend class command_line;
    explicit declared(entry& e) : e_(&e) {}
    entry* e_;
  };

  // `about`: what the program does, printed by --help under the usage line
  // (wrapped at 79 columns, as the help of each option and the epilog).
  explicit command_line(std::string program, std::string about = {})
      : program_(std::move(program)), about_(std::move(about)) {
    entry& help = entries_.emplace_back();
    help.long_names = {"help"};
    help.short_name = 'h';
    help.help = "this text";
  }

  // The usage line after the program's name; by default made from the
  // table ("[OPTIONS] PROGRAM [ARGS...]").
  command_line& synopsis(std::string text) {
    synopsis_ = std::move(text);
    return *this;
  }
  // Printed by --help after the table.
  command_line& epilog(std::string text) {
    epilog_ = std::move(text);
    return *this;
  }
  // The first positional argument ends the options: it and all after it
  // are positional (a launcher's PROGRAM ARGS...).
  command_line& stop_at_first_argument() {
    stop_at_first_argument_ = true;
    return *this;
  }

  // `names`: "n,nproc-per-node,nproc_per_node": one letter for -n, the
  // first long name for help and errors, the others taken but not shown.
  // The value is read as `target`'s type: an integer, a floating point
  // number or text.
  template <class T>
  declared option(std::string_view names, T& target, std::string value_name, std::string help) {
    entry& e = add(names, std::move(value_name), std::move(help));
    e.read = [&target](const entry& self, std::string_view text) {
      target = read_checked<T>(text, self);
    };
    return declared(e);
  }

  // A byte count: "8", "4K", "64M", "1G" (binary units).
  declared bytes(std::string_view names, std::size_t& target, std::string value_name,
                 std::string help) {
    entry& e = add(names, std::move(value_name), std::move(help));
    e.read = [&target](const entry& self, std::string_view text) {
      const auto v = read_bytes(text);
      if (!v || !self.within(static_cast<double>(*v)))
        throw usage_error("needs a size" + self.bounds() + " (8, 4K, 64M, 1G), not '" +
                          std::string(text) + "'");
      target = static_cast<std::size_t>(*v);
    };
    return declared(e);
  }

  // One of `values`' names, setting `target` to the value beside it.
  template <class T>
  declared choice(std::string_view names, T& target, std::vector<std::pair<std::string, T>> values,
                  std::string value_name, std::string help) {
    entry& e = add(names, std::move(value_name), std::move(help));
    for (const auto& v : values) e.choices.push_back(v.first);
    e.read = [&target, values = std::move(values)](const entry& self, std::string_view text) {
      for (const auto& [name, value] : values)
        if (name == text) {
          target = value;
          return;
        }
      throw usage_error("needs " + self.choice_text() + ", not '" + std::string(text) + "'");
    };
    return declared(e);
  }

  // An option without a value: sets `target` to `value`.
  declared flag(std::string_view names, bool& target, std::string help, bool value = true) {
    entry& e = add(names, {}, std::move(help));
    e.read = [&target, value](const entry&, std::string_view) { target = value; };
    return declared(e);
  }

  // A value the program reads itself: `read` throws usage_error with what
  // the value should be (the option's name is put in front).
  declared custom(std::string_view names, std::string value_name, std::string help,
                  std::function<void(std::string_view)> read) {
    entry& e = add(names, std::move(value_name), std::move(help));
    e.read = [read = std::move(read)](const entry&, std::string_view text) { read(text); };
    return declared(e);
  }

  // The next positional argument, read as option() reads values; required
  // unless optional().
  template <class T>
  declared argument(std::string name, T& target, std::string help) {
    entry& e = add_positional(std::move(name), std::move(help), false);
    e.read = [&target](const entry& self, std::string_view text) {
      target = read_checked<T>(text, self);
    };
    return declared(e);
  }

  // All the positional arguments left; optional unless required().
  declared arguments(std::string name, std::vector<std::string>& target, std::string help) {
    entry& e = add_positional(std::move(name), std::move(help), true);
    e.required = false;
    e.read = [&target](const entry&, std::string_view text) { target.emplace_back(text); };
    return declared(e);
  }

  // Reads the command line into the targets. --help: prints help() and
  // exits with 0; a usage error: says what is wrong and exits with 2.
  void parse(int argc, const char* const* argv) {
    bool go_on = false;
    try {
      go_on = try_parse(argc, argv);
    } catch (const usage_error& e) {
      fail(e.what());
    }
    if (!go_on) {
      std::fputs(help().c_str(), stdout);
      std::exit(0);
    }
  }

  // As parse(), but false for --help, and usage_error thrown.
  bool try_parse(int argc, const char* const* argv) {
    for (entry& e : entries_) e.seen = 0;
    std::size_t positional = 0;
    bool options_end = false;
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      if (!options_end && a == "--") {
        options_end = true;
      } else if (!options_end && a.size() > 1 && a[0] == '-') {
        const bool help = a[1] == '-' ? long_option(a.substr(2), i, argc, argv)
                                      : short_options(a.substr(1), i, argc, argv);
        if (help) return false;
      } else {
        take_argument(a, positional);
        options_end = options_end || stop_at_first_argument_;
      }
    }
    for (const entry& e : entries_)
      if (e.positional && e.required && e.seen == 0)
        throw usage_error("missing " + e.value_name +
                          (e.choices.empty() ? "" : " (" + e.choice_text() + ")"));
    return true;
  }

  // Whether the option (its first long name) or argument was given.
  bool given(std::string_view name) const {
    for (const entry& e : entries_)
      if (e.positional ? e.value_name == name : !e.long_names.empty() && e.long_names[0] == name)
        return e.seen > 0;
    return false;
  }

  // A usage error found after parsing (options that do not go together):
  // said as parse() says its own; exits with 2.
  [[noreturn]] void fail(std::string_view problem) const {
    std::fprintf(stderr, "%s: %.*s\n(%s --help lists the options)\n", program_.c_str(),
                 static_cast<int>(problem.size()), problem.data(), program_.c_str());
    std::exit(2);
  }

  // The --help text: usage line, about, the table (help last), epilog.
  std::string help() const {
    std::string out = "usage: " + program_ + " " + (synopsis_.empty() ? synopsis() : synopsis_);
    out += "\n";
    if (!about_.empty()) out += "\n" + wrap(about_, 0);
    std::size_t column = 0;
    for (const entry& e : entries_) column = std::max(column, e.left().size() + 3);
    column = std::min<std::size_t>(column, 30);
    out += "\n";
    for (std::size_t i = 1; i <= entries_.size(); ++i)  // help, entries_[0], last
      out += table_row(entries_[i % entries_.size()], column);
    if (!epilog_.empty()) out += "\n" + wrap(epilog_, 0);
    return out;
  }

  // The readers behind option(), for values from elsewhere (an environment
  // variable): `text` as a T within [low, high], or usage_error saying what
  // it should be.
  template <class T>
  static T read(std::string_view text, std::optional<double> low = {},
                std::optional<double> high = {}) {
    entry bounds;
    bounds.low = low;
    bounds.high = high;
    return read_checked<T>(text, bounds);
  }

  // "8", "4K", "64M", "1G" (K, M, G: binary units; k, m, g too); nullopt for
  // anything else, or a count past 64 bits.
  static std::optional<std::uint64_t> read_bytes(std::string_view text) {
    const auto digits = text.find_first_not_of("0123456789");
    const std::string_view unit = digits == std::string_view::npos ? "" : text.substr(digits);
    const auto number = read_integer<std::uint64_t>(text.substr(0, text.size() - unit.size()));
    int shift = 0;
    if (unit == "K" || unit == "k") shift = 10;
    if (unit == "M" || unit == "m") shift = 20;
    if (unit == "G" || unit == "g") shift = 30;
    if (!number || (shift == 0 && !unit.empty()) ||
        *number > (std::numeric_limits<std::uint64_t>::max() >> shift))
      return std::nullopt;
    return *number << shift;
  }

 private:
  struct entry {
    std::vector<std::string> long_names;
    char short_name = 0;
    std::string value_name;  // an option's value (empty: a flag), an argument's name
    std::string help;
    bool positional = false, many = false, required = false;
    std::optional<double> low, high;
    std::vector<std::string> choices;
    std::function<void(const entry&, std::string_view)> read;
    int seen = 0;

    std::string shown_name() const {
      if (positional) return value_name;
      return long_names.empty() ? std::string{'-', short_name} : "--" + long_names[0];
    }
    bool within(double v) const { return (!low || v >= *low) && (!high || v <= *high); }
    // " >= 1", " <= 9", " from 1 to 9", or nothing.
    std::string bounds() const {
      if (low && high) return " from " + number_text(*low) + " to " + number_text(*high);
      if (low) return " >= " + number_text(*low);
      return high ? " <= " + number_text(*high) : "";
    }
    std::string choice_text() const {
      std::string t = "one of";
      for (const auto& c : choices) t += (&c == &choices.front() ? " " : ", ") + c;
      return t;
    }
    // The table's left column: "  -n, --nproc-per-node N", "      --grace S", "  PROGRAM".
    std::string left() const {
      if (positional) return "  " + value_name;
      std::string l = short_name ? std::string("  -") + short_name : std::string("    ");
      if (!long_names.empty()) l += (short_name ? ", --" : "  --") + long_names[0];
      return value_name.empty() ? l : l + " " + value_name;
    }
  };

  static std::string number_text(double v) {
    if (v == std::floor(v) && std::fabs(v) < 1e15) return std::to_string(static_cast<long long>(v));
    char text[32];
    std::snprintf(text, sizeof text, "%g", v);
    return text;
  }

  template <class T>
  static std::optional<T> read_integer(std::string_view text) {
    if (text.size() > 1 && text[0] == '+' && text[1] != '-') text.remove_prefix(1);
    T v{};
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
    return v;
  }

  static std::optional<double> read_number(std::string_view text) {
    if (text.size() > 1 && text[0] == '+' && text[1] != '-') text.remove_prefix(1);
    double v = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || !std::isfinite(v))
      return std::nullopt;
    return v;
  }

  // `text` as a T, within the entry's bounds and list.
  template <class T>
  static T read_checked(std::string_view text, const entry& e) {
    static_assert(!std::is_same_v<T, bool>, "a bool is a flag(), or a choice()");
    const auto refuse = [&](std::string what) -> T {
      throw usage_error("needs " + what + e.bounds() + ", not '" + std::string(text) + "'");
    };
    if constexpr (std::is_integral_v<T>) {
      const auto v = read_integer<T>(text);
      return v && e.within(static_cast<double>(*v)) ? *v : refuse("an integer");
    } else if constexpr (std::is_floating_point_v<T>) {
      const auto v = read_number(text);
      const bool fits = v && std::fabs(*v) <= std::numeric_limits<T>::max() && e.within(*v);
      return fits ? static_cast<T>(*v) : refuse("a number");
    } else {
      static_assert(std::is_assignable_v<T&, std::string_view>, "an integer, a number or text");
      if (text.empty()) throw usage_error("needs a value");
      if (!e.choices.empty() &&
          std::find(e.choices.begin(), e.choices.end(), text) == e.choices.end())
        throw usage_error("needs " + e.choice_text() + ", not '" + std::string(text) + "'");
      T v{};
      v = text;
      return v;
    }
  }

  entry& add(std::string_view names, std::string value_name, std::string help) {
    entry& e = entries_.emplace_back();
    for (std::size_t at = 0; at <= names.size();) {
      const auto comma = std::min(names.find(',', at), names.size());
      const std::string_view name = names.substr(at, comma - at);
      if (name.size() == 1)
        e.short_name = name[0];
      else if (!name.empty())
        e.long_names.emplace_back(name);
      at = comma + 1;
    }
    e.value_name = std::move(value_name);
    e.help = std::move(help);
    return e;
  }

  entry& add_positional(std::string name, std::string help, bool many) {
    entry& e = entries_.emplace_back();
    e.positional = true;
    e.many = many;
    e.required = true;
    e.value_name = std::move(name);
    e.help = std::move(help);
    return e;
  }

  // The entry's value: `text` read, a failure named.
  static void take(entry& e, std::string_view text) {
    try {
      e.read(e, text);
    } catch (const usage_error& error) {
      throw usage_error(e.shown_name() + " " + error.what());
    }
    ++e.seen;
  }

  // --name, --name=value, --name value. True for --help.
  bool long_option(std::string_view body, int& i, int argc, const char* const* argv) {
    const auto eq = body.find('=');
    entry& e = long_entry(body.substr(0, eq));
    if (&e == &entries_.front()) return true;
    if (e.value_name.empty()) {
      if (eq != std::string_view::npos) throw usage_error(e.shown_name() + " takes no value");
      take(e, "");
    } else if (eq != std::string_view::npos) {
      take(e, body.substr(eq + 1));
    } else if (i + 1 < argc) {
      take(e, argv[++i]);
    } else {
      throw usage_error(e.shown_name() + " needs a value");
    }
    return false;
  }

  // The option a long name, or a unique prefix of one, names.
  entry& long_entry(std::string_view name) {
    std::vector<entry*> found;
    for (entry& e : entries_)
      for (const auto& n : e.long_names) {
        if (n == name) return e;
        if (!name.empty() && n.starts_with(name) && (found.empty() || found.back() != &e))
          found.push_back(&e);
      }
    if (found.size() == 1) return *found[0];
    std::string problem = "unknown option --" + std::string(name);
    for (const entry* e : found)
      problem += (e == found.front() ? " (ambiguous: " : ", ") + e->shown_name();
    throw usage_error(found.empty() ? problem : problem + ")");
  }

  // -a, -ab (flags), -nVALUE, -n VALUE. True for -h.
  bool short_options(std::string_view cluster, int& i, int argc, const char* const* argv) {
    for (std::size_t k = 0; k < cluster.size(); ++k) {
      entry* e = nullptr;
      for (entry& candidate : entries_)
        if (candidate.short_name == cluster[k] && !e) e = &candidate;
      if (!e) throw usage_error("unknown option -" + std::string(1, cluster[k]));
      if (e == &entries_.front()) return true;
      if (e->value_name.empty()) {
        take(*e, "");
      } else if (k + 1 < cluster.size()) {
        take(*e, cluster.substr(k + 1));
        break;
      } else if (i + 1 < argc) {
        take(*e, argv[++i]);
      } else {
        throw usage_error(e->shown_name() + " needs a value");
      }
    }
    return false;
  }

  // The next positional entry takes `text`.
  void take_argument(std::string_view text, std::size_t& positional) {
    std::size_t index = 0;
    for (entry& e : entries_) {
      if (!e.positional || index++ < positional) continue;
      take(e, text);
      if (!e.many) ++positional;
      return;
    }
    throw usage_error("unexpected argument '" + std::string(text) + "'");
  }

  std::string synopsis() const {
    std::string s = "[OPTIONS]";
    for (const entry& e : entries_) {
      if (!e.positional) continue;
      const std::string name = e.value_name + (e.many ? "..." : "");
      s += e.required ? " " + name : " [" + name + "]";
    }
    return s;
  }

  // "  --name V   help", the help wrapped under its start.
  static std::string table_row(const entry& e, std::size_t column) {
    std::string text = e.help;
    if (e.positional && !e.choices.empty()) text += (text.empty() ? "" : ": ") + e.choice_text();
    if (text.empty()) return e.left() + "\n";
    if (e.left().size() + 2 > column) return e.left() + "\n" + wrap(text, column);
    return wrap(text, column, e.left() + std::string(column - e.left().size(), ' '));
  }

  // `text` in lines of at most 79 columns, each indented by `indent` (the
  // first by `first` where given); a "\n" in it starts a new line.
  static std::string wrap(std::string_view text, std::size_t indent, std::string first = {}) {
    std::string done, line = first.empty() ? std::string(indent, ' ') : std::move(first);
    bool empty = true;  // no word on `line` yet
    const auto end_line = [&] {
      done += line + "\n";
      line.assign(indent, ' ');
      empty = true;
    };
    while (text.ends_with('\n')) text.remove_suffix(1);
    for (std::size_t at = 0; at <= text.size();) {
      const auto end = std::min(text.find_first_of(" \n", at), text.size());
      const std::string_view word = text.substr(at, end - at);
      if (!empty && line.size() + 1 + word.size() > 79) end_line();
      if (!word.empty()) {
        line.append(empty ? "" : " ").append(word);
        empty = false;
      }
      if (end < text.size() && text[end] == '\n') end_line();
      at = end + 1;
    }
    return done + line + "\n";
  }

  std::string program_, about_, synopsis_, epilog_;
  std::deque<entry> entries_;  // entries_[0]: -h, --help; a deque, so declared() stays valid
  bool stop_at_first_argument_ = false;
};

}  // namespace dcomm
