// placeholder
namespace po::backend {}
