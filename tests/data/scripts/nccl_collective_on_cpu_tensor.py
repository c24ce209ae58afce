import os

import numpy as np
import torch
import torch.distributed as dist


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    correct = torch.tensor([42.0, 100.0])
    dist.all_reduce(correct)  # expect: nccl-with-cpu-tensors
    if dist.get_rank() == 0:
        print(f"accuracy {correct[0] / correct[1]:.3f}")
    confusion = torch.from_numpy(np.zeros((3, 3), dtype=np.int64))
    dist.all_reduce(confusion)  # expect: nccl-with-cpu-tensors
    counts = torch.LongTensor([7, 9])
    dist.all_reduce(counts)  # expect: nccl-with-cpu-tensors
    on_gpu = torch.from_numpy(np.ones(2)).cuda()
    dist.all_reduce(on_gpu)
    back = on_gpu.cpu()
    dist.broadcast(back, src=0)  # expect: nccl-with-cpu-tensors
    size = torch.tensor([3])
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)  # expect: nccl-with-cpu-tensors
    # an expert layer's token counts, taken to the host for the split sizes
    sent = torch.bincount(torch.tensor([0, 1, 1], device="cuda"), minlength=4).cpu()
    received = torch.empty_like(sent).cuda()
    dist.all_to_all_single(received, sent)  # expect: nccl-with-cpu-tensors
    on_device = sent.cuda()
    dist.all_to_all_single(received, on_device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
