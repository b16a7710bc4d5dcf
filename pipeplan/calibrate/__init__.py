"""`pipeplan calibrate`: measure what this machine achieves (matmul and memory rates, links) and write a hardware
file the analytic profiles read instead of datasheet peaks."""
