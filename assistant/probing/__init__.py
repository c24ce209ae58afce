"""The probing side: the probes registered in probes/, and the runner that
launches them through torchrun and reads back every rank's facts.

protocol (the contract shared with probes/), registry (the probes), runner
(the launches), processes (marked process trees, signals), records,
outcomes, machine, recorded (fixture files)."""
