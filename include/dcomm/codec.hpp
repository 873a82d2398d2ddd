// How a value becomes bytes and back: the one customisation point that
// remote calls (dcomm/rpc.hpp) and the object collectives
// (communicator::broadcast_object and its kin) share. A small binary
// format, little-endian as the machines that run dcomm, with no code and no
// type information from the wire beyond a name that both sides compare.
//
// Built in: bool, the integer and floating types, float16 and bfloat16,
// std::string, std::vector, std::array, std::map, std::unordered_map,
// std::set, std::unordered_set, std::optional, std::variant, std::pair and
// std::tuple of those, and trivially copyable structs (copied as their
// bytes: no pointers inside, please; give such a type a codec). A type of
// your own:
//
//   template <> struct dcomm::codec<point> {
//     static std::string name() { return "point"; }
//     static void write(dcomm::writer& w, const point& p) { w(p.x); w(p.label); }
//     static void read(dcomm::reader& r, point& p) { r(p.x); r(p.label); }
//   };
//
// Tensors (remote calls only): a std::vector (or, to send, a std::span) of
// a dcomm dtype of at least attach_bytes travels beside the payload, as a
// message of its own sent from where its elements are and received straight
// into the callee's (or caller's) std::vector: never copied into or out of
// the payload. So a codec writes the members of the value it is given (a
// temporary it makes is written into the payload instead). A writer made
// without a tensor list (the object collectives') writes every array inline.
//
// A reader never reads past its bytes and checks every length before it
// allocates: bytes that do not parse throw payload_error (the RPC agent
// turns it into an error for the caller; an object collective into
// errc::mismatch).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <variant>
#include <vector>

#include "dcomm/dtype.hpp"
#include "dcomm/half.hpp"

namespace dcomm {

// Bytes that do not parse as the type read.
struct payload_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Specialise for a type of your own (see above). The primary template is
// left undefined: a type without a codec is a compile error.
template <class T, class Enable = void>
struct codec;

// Arrays of at least this many bytes of a dcomm dtype travel as tensors
// (above); smaller ones inside the payload, where they cost no message.
inline constexpr std::size_t attach_bytes = 4096;

// A tensor to send: where its elements are (they must stay there until
// the frame is sent: the agent holds the values it writes).
struct tensor_out {
  dtype type;
  std::uint64_t count;
  const void* data;
};

// A tensor received: a std::vector of its dtype, which the reader hands
// over to the value it reads (moved, not copied).
struct tensor_in {
  dtype type;
  std::uint64_t count;
  std::shared_ptr<void> vector;  // std::vector<T> for T of `type`
  void* data;
};

// Appends values to a byte buffer, and tensors to a list when given one.
class writer {
 public:
  explicit writer(std::vector<std::uint8_t>& out, std::vector<tensor_out>* tensors = nullptr)
      : out_(out), tensors_(tensors) {}
  void raw(const void* p, std::size_t n) {
    if (n == 0) return;
    const auto* b = static_cast<const std::uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  template <class T>
  void operator()(const T& v) {
    codec<std::remove_cv_t<T>>::write(*this, v);
  }
  // A temporary is gone before the frame is sent: its tensors go inline.
  template <class T>
  requires(!std::is_lvalue_reference_v<T>) void operator()(T&& v) {
    auto* tensors = std::exchange(tensors_, nullptr);
    codec<std::remove_cv_t<T>>::write(*this, v);
    tensors_ = tensors;
  }
  // Whether n elements of T go as a tensor; if so, it is added.
  template <element_type T>
  bool attach(const T* data, std::size_t n) {
    if (!tensors_ || n * sizeof(T) < attach_bytes) return false;
    tensors_->push_back({dtype_of_v<T>, n, data});
    return true;
  }

 private:
  std::vector<std::uint8_t>& out_;
  std::vector<tensor_out>* tensors_;
};

// Reads values from bytes it does not own, checking every length, and
// takes the tensors that came with them in order.
class reader {
 public:
  reader(const std::uint8_t* p, std::size_t n, std::vector<tensor_in>* tensors = nullptr)
      : p_(p), end_(p + n), tensors_(tensors) {}
  explicit reader(const std::vector<std::uint8_t>& b, std::vector<tensor_in>* tensors = nullptr)
      : reader(b.data(), b.size(), tensors) {}

  std::size_t left() const { return static_cast<std::size_t>(end_ - p_); }
  // Tensors not read yet.
  std::size_t tensors_left() const { return tensors_ ? tensors_->size() - next_tensor_ : 0; }
  void raw(void* out, std::size_t n) {
    if (n > left())
      throw payload_error("the payload ends " + std::to_string(n - left()) + " bytes early");
    if (n) std::memcpy(out, p_, n);
    p_ += n;
  }
  // A count of elements of `element_bytes` each that must still fit in
  // what is left (so a forged count cannot make us allocate).
  std::size_t count(std::size_t element_bytes) {
    std::uint64_t n = 0;
    raw(&n, sizeof n);
    if (element_bytes && n > left() / element_bytes)
      throw payload_error("a length of " + std::to_string(n) + " does not fit in the " +
                          std::to_string(left()) + " bytes left");
    if (!element_bytes && n > (std::uint64_t{1} << 32))
      throw payload_error("a length of " + std::to_string(n) + " empty elements");
    return static_cast<std::size_t>(n);
  }
  // The next tensor, which must hold n elements of `type`.
  tensor_in& next_tensor(dtype type, std::uint64_t n) {
    if (!tensors_left()) throw payload_error("a tensor is missing");
    tensor_in& t = (*tensors_)[next_tensor_++];
    if (t.type != type || t.count != n)
      throw payload_error("a tensor of " + std::to_string(t.count) + " " +
                          std::string(dcomm::name(t.type)) + " where " + std::to_string(n) + " " +
                          std::string(dcomm::name(type)) + " were expected");
    return t;
  }
  // The same, as the std::vector<T> it was received into.
  template <element_type T>
  std::vector<T>& tensor(std::uint64_t n) {
    return *static_cast<std::vector<T>*>(next_tensor(dtype_of_v<T>, n).vector.get());
  }
  template <class T>
  void operator()(T& v) {
    codec<std::remove_cv_t<T>>::read(*this, v);
  }
  template <class T>
  T read() {
    T v{};
    (*this)(v);
    return v;
  }

 private:
  const std::uint8_t* p_;
  const std::uint8_t* end_;
  std::vector<tensor_in>* tensors_;
  std::size_t next_tensor_ = 0;
};

namespace codec_detail {
template <class T>
std::string scalar_name() {
  if constexpr (std::is_same_v<T, bool>)
    return "bool";
  else if constexpr (std::is_same_v<T, char>)
    return "char";
  else if constexpr (std::is_same_v<T, float16>)
    return "f16";
  else if constexpr (std::is_same_v<T, bfloat16>)
    return "bf16";
  else if constexpr (std::is_floating_point_v<T>)
    return "f" + std::to_string(sizeof(T) * 8);
  else if constexpr (std::is_signed_v<T>)
    return "i" + std::to_string(sizeof(T) * 8);
  else
    return "u" + std::to_string(sizeof(T) * 8);
}

template <class T>
constexpr bool is_scalar_v =
    std::is_arithmetic_v<T> || std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;

template <class T>
struct is_composite : std::false_type {};  // has a codec of its own below
template <class T>
struct is_composite<std::optional<T>> : std::true_type {};
template <class A, class B>
struct is_composite<std::pair<A, B>> : std::true_type {};
template <class... Ts>
struct is_composite<std::tuple<Ts...>> : std::true_type {};
template <class T, std::size_t N>
struct is_composite<std::array<T, N>> : std::true_type {};
template <class... Ts>  // its index must be checked, not copied
struct is_composite<std::variant<Ts...>> : std::true_type {};
template <class T>
struct is_span : std::false_type {};
template <class T, std::size_t E>
struct is_span<std::span<T, E>> : std::true_type {};
template <class T, std::size_t E>  // a pointer and a size: never its bytes
struct is_composite<std::span<T, E>> : std::true_type {};

// Copied as its bytes: scalars, enums and trivially copyable structs.
template <class T>
constexpr bool is_plain_v =
    std::is_trivially_copyable_v<T> && !std::is_pointer_v<T> && !std::is_member_pointer_v<T> &&
    !std::is_array_v<T> && !is_composite<T>::value;
}  // namespace codec_detail

// Scalars, enums and trivially copyable structs: their bytes.
template <class T>
struct codec<T, std::enable_if_t<codec_detail::is_plain_v<T>>> {
  static std::string name() {
    if constexpr (codec_detail::is_scalar_v<T>)
      return codec_detail::scalar_name<T>();
    else if constexpr (std::is_enum_v<T>)
      return "enum" + std::to_string(sizeof(T));
    else
      return "struct" + std::to_string(sizeof(T));
  }
  static void write(writer& w, const T& v) { w.raw(&v, sizeof v); }
  static void read(reader& r, T& v) {
    if constexpr (std::is_same_v<T, bool>) {  // a byte other than 0 or 1 is no bool
      std::uint8_t b = 0;
      r.raw(&b, 1);
      if (b > 1) throw payload_error("a bool's byte is " + std::to_string(b));
      v = b != 0;
    } else {
      r.raw(&v, sizeof v);
    }
  }
};

template <>
struct codec<std::string> {
  static std::string name() { return "str"; }
  static void write(writer& w, const std::string& s) {
    const std::uint64_t n = s.size();
    w.raw(&n, sizeof n);
    w.raw(s.data(), s.size());
  }
  static void read(reader& r, std::string& s) {
    s.resize(r.count(1));
    r.raw(s.data(), s.size());
  }
};

namespace codec_detail {
// An array of a dtype: its count, then 1 and a tensor beside the payload,
// or 0 and its elements.
template <class T>
void write_array(writer& w, const T* data, std::size_t n) {
  const std::uint64_t count = n;
  w.raw(&count, sizeof count);
  const std::uint8_t attached = w.attach(data, n) ? 1 : 0;
  w.raw(&attached, 1);
  if (!attached) w.raw(data, n * sizeof(T));
}
}  // namespace codec_detail

template <class T, class A>
struct codec<std::vector<T, A>> {
  static std::string name() { return "vec<" + codec<T>::name() + ">"; }
  static void write(writer& w, const std::vector<T, A>& v) {
    if constexpr (element_type<T>) {
      codec_detail::write_array(w, v.data(), v.size());
    } else {
      const std::uint64_t n = v.size();
      w.raw(&n, sizeof n);
      if constexpr (codec_detail::is_plain_v<T> && !std::is_same_v<T, bool>)
        w.raw(v.data(), v.size() * sizeof(T));
      else
        for (const auto& x : v) w(x);
    }
  }
  static void read(reader& r, std::vector<T, A>& v) {
    if constexpr (element_type<T>) {
      std::uint64_t n = 0;
      r.raw(&n, sizeof n);
      std::uint8_t attached = 0;
      r.raw(&attached, 1);
      if (attached > 1) throw payload_error("an array's form is " + std::to_string(attached));
      if (attached) {
        auto& t = r.tensor<T>(n);
        if constexpr (std::is_same_v<A, std::allocator<T>>)
          v = std::move(t);
        else
          v.assign(t.begin(), t.end());
        return;
      }
      if (n > r.left() / sizeof(T))
        throw payload_error("a length of " + std::to_string(n) + " does not fit in the " +
                            std::to_string(r.left()) + " bytes left");
      v.resize(static_cast<std::size_t>(n));
      r.raw(v.data(), v.size() * sizeof(T));
    } else if constexpr (codec_detail::is_plain_v<T> && !std::is_same_v<T, bool>) {
      v.resize(r.count(sizeof(T)));
      r.raw(v.data(), v.size() * sizeof(T));
    } else {
      // Each element takes at least one byte on the wire, bar empty structs.
      const std::size_t n = r.count(std::is_empty_v<T> ? 0 : 1);
      v.clear();
      v.reserve(n);
      for (std::size_t i = 0; i < n; ++i) {
        T x{};
        r(x);
        v.push_back(std::move(x));
      }
    }
  }
};

// A span of a dtype is sent as the std::vector it is received as, from
// where its elements are (the caller keeps them there until the call
// completes). A handler takes the std::vector: a span has no read.
template <element_type T>
struct codec<std::span<const T>> {
  static std::string name() { return codec<std::vector<T>>::name(); }
  static void write(writer& w, std::span<const T> v) {
    codec_detail::write_array(w, v.data(), v.size());
  }
};

template <class T>
struct codec<std::optional<T>> {
  static std::string name() { return "opt<" + codec<T>::name() + ">"; }
  static void write(writer& w, const std::optional<T>& v) {
    const std::uint8_t has = v ? 1 : 0;
    w.raw(&has, 1);
    if (v) w(*v);
  }
  static void read(reader& r, std::optional<T>& v) {
    std::uint8_t has = 0;
    r.raw(&has, 1);
    if (has > 1) throw payload_error("an optional's flag is " + std::to_string(has));
    if (!has) {
      v.reset();
      return;
    }
    v.emplace();
    r(*v);
  }
};

template <class T, std::size_t N>
struct codec<std::array<T, N>> {
  static std::string name() { return "arr" + std::to_string(N) + "<" + codec<T>::name() + ">"; }
  static void write(writer& w, const std::array<T, N>& a) {
    if constexpr (codec_detail::is_plain_v<T> && !std::is_same_v<T, bool>)
      w.raw(a.data(), sizeof(T) * N);
    else
      for (const auto& x : a) w(x);
  }
  static void read(reader& r, std::array<T, N>& a) {
    if constexpr (codec_detail::is_plain_v<T> && !std::is_same_v<T, bool>)
      r.raw(a.data(), sizeof(T) * N);
    else
      for (auto& x : a) r(x);
  }
};

namespace codec_detail {
// The maps and sets: a count, then the elements in the container's order.
// A key that arrives twice is refused (a container would drop it silently).
template <class C, class Element>
struct associative_codec {
  static void write(writer& w, const C& c) {
    const std::uint64_t n = c.size();
    w.raw(&n, sizeof n);
    for (const auto& x : c) w(x);
  }
  static void read(reader& r, C& c) {
    const std::size_t n = r.count(std::is_empty_v<Element> ? 0 : 1);
    c.clear();
    for (std::size_t i = 0; i < n; ++i) {
      Element x{};
      r(x);
      if (!c.insert(std::move(x)).second) throw payload_error("a key appears twice");
    }
  }
};
}  // namespace codec_detail

template <class K, class V, class... Rest>
struct codec<std::map<K, V, Rest...>>
    : codec_detail::associative_codec<std::map<K, V, Rest...>, std::pair<K, V>> {
  static std::string name() { return "map<" + codec<K>::name() + "," + codec<V>::name() + ">"; }
};
template <class K, class V, class... Rest>
struct codec<std::unordered_map<K, V, Rest...>>
    : codec_detail::associative_codec<std::unordered_map<K, V, Rest...>, std::pair<K, V>> {
  static std::string name() { return "map<" + codec<K>::name() + "," + codec<V>::name() + ">"; }
};
template <class K, class... Rest>
struct codec<std::set<K, Rest...>> : codec_detail::associative_codec<std::set<K, Rest...>, K> {
  static std::string name() { return "set<" + codec<K>::name() + ">"; }
};
template <class K, class... Rest>
struct codec<std::unordered_set<K, Rest...>>
    : codec_detail::associative_codec<std::unordered_set<K, Rest...>, K> {
  static std::string name() { return "set<" + codec<K>::name() + ">"; }
};

// The index of the alternative held, then its value.
template <class... Ts>
struct codec<std::variant<Ts...>> {
  static std::string name() {
    std::string s = "var<";
    ((s += codec<Ts>::name(), s += ","), ...);
    s.back() = '>';
    return s;
  }
  static void write(writer& w, const std::variant<Ts...>& v) {
    if (v.valueless_by_exception()) throw std::invalid_argument("a valueless std::variant");
    const std::uint32_t index = static_cast<std::uint32_t>(v.index());
    w.raw(&index, sizeof index);
    std::visit([&](const auto& x) { w(x); }, v);
  }
  static void read(reader& r, std::variant<Ts...>& v) {
    std::uint32_t index = 0;
    r.raw(&index, sizeof index);
    if (index >= sizeof...(Ts))
      throw payload_error("a variant's index is " + std::to_string(index) + " of " +
                          std::to_string(sizeof...(Ts)));
    read_alternative(r, v, index, std::index_sequence_for<Ts...>{});
  }

 private:
  template <std::size_t... I>
  static void read_alternative(reader& r, std::variant<Ts...>& v, std::uint32_t index,
                               std::index_sequence<I...>) {
    (void)((index == I && (r(v.template emplace<I>()), true)) || ...);
  }
};

// The signature of a list of types: "(i32,str,vec<f32>)".
template <class... Ts>
std::string signature() {
  std::string s = "(";
  ((s += codec<std::remove_cvref_t<Ts>>::name(), s += ","), ...);
  if (s.size() > 1) s.pop_back();
  return s + ")";
}

template <class... Ts>
struct codec<std::tuple<Ts...>> {
  static std::string name() { return signature<Ts...>(); }
  static void write(writer& w, const std::tuple<Ts...>& t) {
    std::apply([&](const auto&... x) { (w(x), ...); }, t);
  }
  static void read(reader& r, std::tuple<Ts...>& t) {
    std::apply([&](auto&... x) { (r(x), ...); }, t);
  }
};

template <class A, class B>
struct codec<std::pair<A, B>> {
  static std::string name() { return signature<A, B>(); }
  static void write(writer& w, const std::pair<A, B>& p) {
    w(p.first);
    w(p.second);
  }
  static void read(reader& r, std::pair<A, B>& p) {
    r(p.first);
    r(p.second);
  }
};

}  // namespace dcomm
