"""The dp, ep, pp, cp and recompute axes: each module plans its axis and builds its part of the program from the one trace the driver makes."""
