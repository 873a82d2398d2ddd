// The two programs of ptdist.py, from an introduction to distributed
// training with PyTorch over MPI (run with mpiexec and backend='mpi'), in
// C++ with dcomm's MPI backend, printing what that text shows:
//
//   mpirun -np 2 mpi_ptdist send_recv    rank 0 sends [1, -1] to rank 1
//   mpirun -np 3 mpi_ptdist all_reduce   x = 1, 2, -3 summed: every rank has 0
//
// Rank and world come from mpirun: no init_method, no store.
#include <cstdio>
#include <dcomm/command_line.hpp>
#include <dcomm/dcomm.hpp>
#include <dcomm/mpi.hpp>
#include <string>
#include <vector>

namespace {

using comm_t = dcomm::communicator<dcomm::mpi_backend>;

// torch's way of printing a float tensor: tensor([ 1., -1.])
std::string show(const std::vector<float>& v) {
  bool negative = false;
  for (float x : v) negative = negative || x < 0;
  std::string s = "tensor([";
  for (std::size_t i = 0; i < v.size(); ++i) {
    char item[32];
    std::snprintf(item, sizeof item, negative && v[i] >= 0 ? " %.0f." : "%.0f.",
                  static_cast<double>(v[i]));
    s += (i ? ", " : "") + std::string(item);
  }
  return s + "])";
}

// ptdist.py's point to point: x goes from rank 0 to rank 1's z.
void send_recv(comm_t& c) {
  if (c.rank() == 0) {
    std::vector<float> x{1.0f, -1.0f};
    c.send(x, 1, dcomm::blocking);
    std::printf("Rank-0 has sent the following tensor to Rank-1\n%s\n", show(x).c_str());
  } else if (c.rank() == 1) {
    std::vector<float> z(2, 0.0f);  // a placeholder of the same shape
    c.recv(z, 0, dcomm::blocking);
    std::printf("Rank-1 has recieved the following tensor from Rank-0\n%s\n", show(z).c_str());
  }
}

// ptdist.py's main(rank, world): an all_reduce in a world of three.
void all_reduce(comm_t& c) {
  std::vector<float> x;
  if (c.rank() == 0)
    x = {1.0f};
  else if (c.rank() == 1)
    x = {2.0f};
  else if (c.rank() == 2)
    x = {-3.0f};
  else
    x = {0.0f};
  c.all_reduce(x, dcomm::sum, dcomm::blocking);
  std::printf("Rank %d has %s\n", c.rank(), show(x).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string program;
  dcomm::command_line cl("mpi_ptdist",
                         "ptdist.py's programs on the MPI backend: run under mpirun -np N.");
  cl.argument("PROGRAM", program, "send_recv: -np 2; all_reduce: -np 3")
      .one_of({"send_recv", "all_reduce"});
  cl.parse(argc, argv);
  try {
    auto comm =
        dcomm::init_process_group<dcomm::mpi_backend>({});  // dist.init_process_group('mpi')
    if (program == "send_recv")
      send_recv(comm);
    else
      all_reduce(comm);
    std::fflush(stdout);
  } catch (const dcomm::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
