"""Tools over the compiler: the command line, the model zoo, test helpers and the HTML plan report."""
