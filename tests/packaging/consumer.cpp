// A program of a project that uses dcomm as a package: it reads its rank
// from the launcher's environment (dcomm-run's, here) through env://.
#include <cstdio>
#include <dcomm/init_method.hpp>

#ifndef ASIO_STANDALONE
#error "dcomm's compile definitions did not come with the package"
#endif

int main() {
  const dcomm::init_spec spec = dcomm::parse_init_method("env://");
  std::printf("consumer: rank %d of %d\n", spec.rank, spec.world_size);
  return 0;
}
