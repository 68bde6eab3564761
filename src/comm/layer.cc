// placeholder until the comm layer lands
namespace po::comm {}
