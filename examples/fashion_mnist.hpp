// Fashion-MNIST from Debian's dataset-fashion-mnist: the gzip IDX files,
// read with zlib, normalised; and the command-line options of the training
// examples. Shared by the examples that train on it.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <dcomm/command_line.hpp>
#include <filesystem>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace fashion_mnist {

inline constexpr const char* default_dir = "/usr/share/datasets/fashion-mnist";

struct dataset {
  std::vector<float> images;  // n x 784, normalised
  std::vector<std::uint8_t> labels;
  std::size_t size() const { return labels.size(); }
  std::span<const float> image(std::size_t i) const { return {images.data() + i * 784, 784}; }
};

inline std::vector<std::uint8_t> read_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open " + path);
  std::vector<std::uint8_t> out;
  std::uint8_t chunk[1 << 16];
  int n;
  while ((n = gzread(f, chunk, sizeof chunk)) > 0) out.insert(out.end(), chunk, chunk + n);
  bool failed = n < 0;
  gzclose(f);
  if (failed) throw std::runtime_error("cannot decompress " + path + " (corrupt gzip?)");
  return out;
}

inline std::uint32_t big_endian(const std::vector<std::uint8_t>& b, std::size_t at) {
  return std::uint32_t{b[at]} << 24 | std::uint32_t{b[at + 1]} << 16 |
         std::uint32_t{b[at + 2]} << 8 | std::uint32_t{b[at + 3]};
}

// The IDX files of (Fashion-)MNIST: magic 0x803 for images, 0x801 for labels.
inline dataset load(const std::string& dir, const std::string& prefix, std::size_t limit) {
  const std::string images_path = dir + "/" + prefix + "-images-idx3-ubyte.gz";
  const std::string labels_path = dir + "/" + prefix + "-labels-idx1-ubyte.gz";
  for (const auto& p : {images_path, labels_path})
    if (!std::filesystem::exists(p))
      throw std::runtime_error(p +
                               " not found. Install Debian's Fashion-MNIST package: "
                               "apt-get install dataset-fashion-mnist (or pass --data DIR)");
  auto img = read_gzip(images_path), lab = read_gzip(labels_path);
  if (img.size() < 16 || big_endian(img, 0) != 0x803 || big_endian(img, 8) != 28 ||
      big_endian(img, 12) != 28)
    throw std::runtime_error(images_path + " is not an IDX file of 28x28 images");
  if (lab.size() < 8 || big_endian(lab, 0) != 0x801)
    throw std::runtime_error(labels_path + " is not an IDX label file");
  std::size_t n = big_endian(img, 4);
  if (big_endian(lab, 4) != n || img.size() != 16 + n * 784 || lab.size() != 8 + n)
    throw std::runtime_error(prefix + ": image and label files do not agree in size");
  if (limit) n = std::min(n, limit);
  dataset d;
  d.images.resize(n * 784);
  d.labels.assign(lab.begin() + 8, lab.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  // Fashion-MNIST's mean and standard deviation of a pixel.
  for (std::size_t i = 0; i < n * 784; ++i)
    d.images[i] = (static_cast<float>(img[16 + i]) / 255.0f - 0.2860f) / 0.3530f;
  return d;
}

// The options the training examples share, into `s` (a program's settings:
// world, epochs, lr, momentum, batch, data, train_limit, and seed where it
// has one), whose values on entry are the defaults --help shows.
template <class Settings>
void training_options(dcomm::command_line& cl, Settings& s, const std::string& batch_help) {
  const auto was = [](const auto& v) {
    std::ostringstream text;
    text << v;
    return "; " + text.str();
  };
  cl.option("world", s.world, "N",
            "spawn N local ranks; 0: this process is one rank of a launched job (env://)")
      .at_least(0);
  cl.option("epochs", s.epochs, "N", "passes over the training set" + was(s.epochs)).at_least(1);
  cl.option("lr", s.lr, "RATE", "the learning rate" + was(s.lr));
  cl.option("momentum", s.momentum, "M", "SGD's momentum" + was(s.momentum));
  cl.option("batch", s.batch, "N", batch_help + was(s.batch)).at_least(1);
  if constexpr (requires { s.seed; })
    cl.option("seed", s.seed, "N", "the shuffle's seed" + was(s.seed));
  cl.option("data", s.data, "DIR", "the dataset's folder" + was(s.data));
  cl.option("train-limit", s.train_limit, "N", "use the first N training images; 0: all");
}

}  // namespace fashion_mnist
