// The programs of PyTorch's "Writing Distributed Applications with PyTorch"
// tutorial, and the all_reduce of ptdist.py (see mpi_ptdist.cpp), in C++ with
// dcomm; docs/tutorial.md walks through them.
//
//   tutorial PROGRAM [--world N]     spawns N local ranks (the tutorial's
//                                    mp.Process template)
//   dcomm-run -n N tutorial PROGRAM  one rank per process, from env://
//
// PROGRAM: send_recv, isend_irecv, all_reduce, group, collectives, ring,
// ring_chunked. The tutorial's synchronous SGD is the train_fashion_mnist
// example.
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <dcomm/command_line.hpp>
#include <dcomm/dcomm.hpp>
#include <functional>
#include <map>
#include <string>
#include <vector>

using namespace std::chrono_literals;

namespace {

using comm_t = dcomm::communicator<dcomm::cpu_backend>;

// One write per line, so lines of different ranks never mix.
[[gnu::format(printf, 1, 2)]] void say(const char* format, ...) {
  char line[512];
  std::va_list args;
  va_start(args, format);
  int n = std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  if (n > 0) std::fwrite(line, 1, std::min(static_cast<std::size_t>(n), sizeof line - 1), stdout);
  std::fflush(stdout);
}

std::string show(const std::vector<float>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    char item[32];
    std::snprintf(item, sizeof item, "%s%g", i ? ", " : "", static_cast<double>(v[i]));
    s += item;
  }
  return s + "]";
}

// ---------------------------------------------------- point to point

// "Blocking point-to-point communication": both ranks end with 1.
void send_recv(comm_t& c) {
  std::vector<float> tensor{0.0f};
  if (c.rank() == 0) {
    tensor[0] += 1;
    c.send(tensor, 1, dcomm::blocking);  // to process 1
  } else if (c.rank() == 1) {
    c.recv(tensor, 0, dcomm::blocking);  // from process 0
  }
  say("Rank %d has data %g\n", c.rank(), static_cast<double>(tensor[0]));
}

// "Non-blocking point-to-point communication": the request is waited on
// before the tensor is touched again.
void isend_irecv(comm_t& c) {
  std::vector<float> tensor{0.0f};
  dcomm::request req;
  if (c.rank() == 0) {
    tensor[0] += 1;
    req = c.isend(tensor, 1);
    say("Rank 0 started sending\n");
  } else if (c.rank() == 1) {
    req = c.irecv(tensor, 0);
    say("Rank 1 started receiving\n");
  }
  if (req.valid()) req.wait();
  say("Rank %d has data %g\n", c.rank(), static_cast<double>(tensor[0]));
}

// ---------------------------------------------------------- collectives

// ptdist.py's: in a world of 3, ranks hold 1, 2 and -3; the sum is 0 everywhere.
void all_reduce(comm_t& c) {
  const float inputs[] = {1.0f, 2.0f, -3.0f};
  std::vector<float> x{c.rank() < 3 ? inputs[c.rank()] : 0.0f};
  c.all_reduce(x, dcomm::sum, dcomm::blocking);
  say("Rank %d has %s\n", c.rank(), show(x).c_str());
}

// "All-Reduce" within new_group({0, 1}): ranks 0 and 1 end with 2.
void group(comm_t& c) {
  auto group = c.new_group({0, 1});  // every rank calls it; members get a group
  std::vector<float> tensor{1.0f};
  if (group) group->all_reduce(tensor, dcomm::sum, dcomm::blocking);
  say("Rank %d has data %g%s\n", c.rank(), static_cast<double>(tensor[0]),
      group ? "" : " (not in the group)");
}

// Every collective of the tutorial's list, and the two it leaves out.
void collectives(comm_t& c) {
  const int r = c.rank(), n = c.size();
  auto fr = static_cast<float>(r);

  std::vector<float> b{r == 0 ? 42.0f : -1.0f};
  c.broadcast(b, 0, dcomm::blocking);
  say("broadcast from 0: rank %d has %s\n", r, show(b).c_str());

  std::vector<float> red{fr + 1};
  c.reduce(red, 0, dcomm::sum, dcomm::blocking);
  if (r == 0) say("reduce(sum) to 0: rank 0 has %s\n", show(red).c_str());

  for (auto [name, value] : {std::pair{"sum", 0}, {"prod", 1}, {"max", 2}, {"min", 3}}) {
    std::vector<float> t{fr + 1};
    switch (value) {
      case 0:
        c.all_reduce(t, dcomm::sum, dcomm::blocking);
        break;
      case 1:
        c.all_reduce(t, dcomm::prod, dcomm::blocking);
        break;
      case 2:
        c.all_reduce(t, dcomm::max, dcomm::blocking);
        break;
      default:
        c.all_reduce(t, dcomm::min, dcomm::blocking);
        break;
    }
    say("all_reduce(%s): rank %d has %s\n", name, r, show(t).c_str());
  }

  // scatter: the root's list, one entry per rank.
  std::vector<float> scatter_list;
  if (r == 0)
    for (int i = 0; i < n; ++i) scatter_list.push_back(10.0f * static_cast<float>(i));
  std::vector<float> piece(1);
  c.scatter(scatter_list, piece, 0, dcomm::blocking);
  say("scatter from 0: rank %d has %s\n", r, show(piece).c_str());

  // gather: rank i's tensor lands at entry i of the root's list.
  std::vector<float> mine{fr * fr};
  std::vector<float> gather_list(r == 0 ? static_cast<std::size_t>(n) : 0);
  c.gather(mine, gather_list, 0, dcomm::blocking);
  if (r == 0) say("gather to 0: rank 0 has %s\n", show(gather_list).c_str());

  std::vector<float> everyone(static_cast<std::size_t>(n));
  c.all_gather(mine, everyone, dcomm::blocking);
  say("all_gather: rank %d has %s\n", r, show(everyone).c_str());

  // reduce_scatter: entry i of everyone's input, summed, goes to rank i.
  std::vector<float> contributions(static_cast<std::size_t>(n), fr + 1), share(1);
  c.reduce_scatter(contributions, share, dcomm::sum, dcomm::blocking);
  say("reduce_scatter(sum): rank %d has %s\n", r, show(share).c_str());

  // all_to_all: entry j of rank i's input becomes entry i of rank j's output.
  std::vector<float> outgoing, incoming(static_cast<std::size_t>(n));
  for (int j = 0; j < n; ++j) outgoing.push_back(static_cast<float>(10 * r + j));
  c.all_to_all(outgoing, incoming, dcomm::blocking);
  say("all_to_all: rank %d has %s\n", r, show(incoming).c_str());

  c.barrier(dcomm::blocking);
  say("barrier: rank %d passed\n", r);
}

// ------------------------------------------------------ ring all-reduce

// The tutorial's "Our Own Ring-Allreduce": whole buffers passed around the
// ring, size-1 steps; recv gets the sum of every rank's send.
void ring_allreduce(comm_t& c, const std::vector<float>& send, std::vector<float>& recv) {
  const int rank = c.rank(), size = c.size();
  std::vector<float> send_buff = send, recv_buff = send, accum = send;
  const int left = (rank - 1 + size) % size, right = (rank + 1) % size;
  for (int i = 0; i < size - 1; ++i) {
    auto& outgoing = i % 2 == 0 ? send_buff : recv_buff;
    auto& incoming = i % 2 == 0 ? recv_buff : send_buff;
    auto send_req = c.isend(outgoing, right);
    c.recv(incoming, left, dcomm::blocking);
    for (std::size_t k = 0; k < accum.size(); ++k) accum[k] += incoming[k];
    send_req.wait();
  }
  recv = accum;
}

// The exercise the tutorial leaves to the reader (DeepSpeech's version):
// the buffer in `size` chunks, so every link carries a different chunk at
// every step. A reduce-scatter (after size-1 steps rank r holds the full sum
// of chunk r+1), then an all-gather passes the finished chunks around.
void ring_allreduce_chunked(comm_t& c, const std::vector<float>& send, std::vector<float>& recv) {
  const int rank = c.rank(), size = c.size();
  const int left = (rank - 1 + size) % size, right = (rank + 1) % size;
  recv = send;
  // Chunk k: [first[k], first[k+1]); sizes differ by at most one element.
  std::vector<std::size_t> first;
  for (int k = 0; k <= size; ++k)
    first.push_back(send.size() * static_cast<std::size_t>(k) / static_cast<std::size_t>(size));
  auto chunk = [&](int k) {
    k = (k % size + size) % size;
    return std::span<float>(
        recv.data() + first[static_cast<std::size_t>(k)],
        first[static_cast<std::size_t>(k) + 1] - first[static_cast<std::size_t>(k)]);
  };
  std::vector<float> incoming(send.size() / static_cast<std::size_t>(size) + 1);
  for (int step = 0; step < size - 1; ++step) {  // reduce-scatter
    auto out = chunk(rank - step), in = chunk(rank - step - 1);
    auto send_req = c.isend(out, right, 1);
    std::span<float> landing(incoming.data(), in.size());
    c.recv(landing, left, 1, dcomm::blocking);
    for (std::size_t k = 0; k < in.size(); ++k) in[k] += landing[k];
    send_req.wait();
  }
  for (int step = 0; step < size - 1; ++step) {  // all-gather
    auto out = chunk(rank + 1 - step), in = chunk(rank - step);
    auto send_req = c.isend(out, right, 2);
    c.recv(in, left, 2, dcomm::blocking);
    send_req.wait();
  }
}

void ring(comm_t& c, bool chunked) {
  // 1003 elements: not divisible by the world size. Small integers, so the
  // sums are exact whatever the order.
  std::vector<float> send(1003), recv, expected;
  for (std::size_t i = 0; i < send.size(); ++i)
    send[i] = static_cast<float>((c.rank() + 1) * static_cast<int>(i % 13));
  if (chunked)
    ring_allreduce_chunked(c, send, recv);
  else
    ring_allreduce(c, send, recv);
  expected = send;
  c.all_reduce(expected, dcomm::sum, dcomm::blocking);
  say("Rank %d: %s ring all-reduce of %zu floats %s all_reduce (recv[12] = %g)\n", c.rank(),
      chunked ? "chunked" : "whole-buffer", send.size(),
      recv == expected ? "matches" : "DIFFERS FROM", static_cast<double>(recv[12]));
  if (recv != expected) std::exit(1);
}

struct program {
  int default_world;
  std::function<void(comm_t&)> run;
};

const std::map<std::string, program>& programs() {
  static const std::map<std::string, program> all = {
      {"send_recv", {2, send_recv}},
      {"isend_irecv", {2, isend_irecv}},
      {"all_reduce", {3, all_reduce}},
      {"group", {4, group}},
      {"collectives", {4, collectives}},
      {"ring", {4, [](comm_t& c) { ring(c, false); }}},
      {"ring_chunked", {4, [](comm_t& c) { ring(c, true); }}},
  };
  return all;
}

// The tutorial's init_process: join the group, run the program.
int init_process(const program& p) {
  auto c = dcomm::init_process_group<dcomm::cpu_backend>({.init_method = "env://", .timeout = 30s});
  p.run(c);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string name;
  int world = 0;  // 0: the program's own
  std::vector<std::string> names;
  for (const auto& [n, p] : programs()) names.push_back(n);
  dcomm::command_line cl("tutorial",
                         "The programs of PyTorch's distributed tutorial (docs/tutorial.md).");
  cl.argument("PROGRAM", name, "the program to run").one_of(names);
  cl.option("world", world, "N",
            "spawn N local ranks (each program has its own default); under a launcher (RANK and "
            "WORLD_SIZE set) this process is one rank")
      .at_least(1);
  cl.parse(argc, argv);
  const program& p = programs().at(name);
  if (world == 0) world = p.default_world;
  try {
    if (std::getenv("RANK") && std::getenv("WORLD_SIZE"))
      return init_process(p);  // started by a launcher: this process is one rank
    dcomm::spawn(world, [&](int) { return init_process(p); });
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tutorial %s: %s\n", name.c_str(), e.what());
    return 1;
  }
}
