"""Pipeline parallelism by hand over two ranks: each rank is a stage, not a
replica, so both read the same batches (one seeded generator, no
DistributedSampler); activations go forward and gradients back with
isend / irecv."""

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset


def p2p(op, tensor, peer):
    for request in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)]):
        request.wait()


def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = torch.nn.Linear(32, 32).cuda()
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 32))
    loader = DataLoader(data, batch_size=64, shuffle=True, generator=generator, drop_last=True)
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
        if rank > 0:
            x = torch.empty_like(x).requires_grad_()
            p2p(dist.irecv, x, rank - 1)
        out = stage(x)
        if rank < world - 1:
            p2p(dist.isend, out.detach(), rank + 1)
            grad = torch.empty_like(out)
            p2p(dist.irecv, grad, rank + 1)
            out.backward(grad)
        else:
            torch.nn.functional.mse_loss(out, y).backward()
            p2p(dist.isend, x.grad, rank - 1)
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
