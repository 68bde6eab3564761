// placeholder until the layer lands
namespace po::optim {}
