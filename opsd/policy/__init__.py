"""Pure decision logic of the controller: no I/O, no clocks (time is an argument), no SDK imports."""
