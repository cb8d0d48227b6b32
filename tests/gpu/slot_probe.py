"""Run as a GPU slot's proc would be (`run_on_slot_gpu`): prints how many CUDA devices the
process sees and the UUID of cuda:0."""

import torch

from colocate import telemetry

print(torch.cuda.device_count(), telemetry.device_uuid(0))
