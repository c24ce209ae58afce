"""The probing side: the probes registered in probes/, and the runner that
launches them through torchrun and reads back every rank's facts."""
