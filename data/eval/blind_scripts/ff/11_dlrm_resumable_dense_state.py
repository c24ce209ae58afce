"""Resumable DLRM training (TorchRec) for preemptible multi-node jobs.

Sharded embedding tables and their fused optimizer state go through
torch.distributed.checkpoint. The dense optimizer, LR schedule and step
counter are replicated, so rank 0 writes them once into trainer_state.pt.

sbatch scripts/dlrm_8x8.sbatch  (srun ... torchrun --nnodes 8 --nproc_per_node 8 ... this file)
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from criteo_loader import make_criteo_loader  # project-local binary Criteo reader (rank-sharded)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/lustre/criteo_1tb/binary")
    p.add_argument("--synthetic", action="store_true", help="RandomRecDataset for smoke tests")
    p.add_argument("--ckpt_dir", default="/lustre/ckpt/dlrm_1tb")
    p.add_argument("--ckpt_every", type=int, default=2000)
    p.add_argument("--total_steps", type=int, default=60000)
    p.add_argument("--warmup_steps", type=int, default=2000)
    p.add_argument("--batch_size", type=int, default=2048)
    p.add_argument("--emb_dim", type=int, default=128)
    p.add_argument("--num_embeddings", type=int, default=40_000_000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--emb_lr", type=float, default=0.01)
    return p.parse_args()


def build(args, device):
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=args.emb_dim,
                               num_embeddings=args.num_embeddings, feature_names=[f])
            for f in DEFAULT_CAT_NAMES
        ],
        device=torch.device("meta"),
    )
    net = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=len(DEFAULT_INT_NAMES),
            dense_arch_layer_sizes=[512, 256, args.emb_dim],
            over_arch_layer_sizes=[1024, 1024, 512, 256, 1],
            dense_device=device,
        )
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, net.model.sparse_arch.parameters(), {"lr": args.emb_lr})
    planner = EmbeddingShardingPlanner(
        topology=Topology(local_world_size=get_local_size(), world_size=dist.get_world_size(),
                          compute_device="cuda"),
        batch_size=args.batch_size,
        storage_reservation=HeuristicalStorageReservation(percentage=0.1),
    )
    plan = planner.collective_plan(net, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(net, device=device, plan=plan)
    dense_params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    dense_opt = torch.optim.Adam(dense_params, lr=args.lr)

    def lr_lambda(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(dense_opt, lr_lambda)
    return model, dense_opt, sched


def save(args, model, dense_opt, sched, step):
    path = os.path.join(args.ckpt_dir, f"step_{step:07d}")
    dcp.save(
        {"model": model.state_dict(), "sparse_optim": model.fused_optimizer.state_dict()},
        checkpoint_id=path,
    )
    if dist.get_rank() == 0:
        torch.save(
            {"dense_optim": dense_opt.state_dict(), "sched": sched.state_dict(), "step": step},
            os.path.join(path, "trainer_state.pt"),
        )
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(args.ckpt_dir, ".latest.tmp")
        with open(tmp, "w") as f:
            f.write(path)
        os.replace(tmp, os.path.join(args.ckpt_dir, "latest"))


def maybe_resume(args, model, dense_opt, sched):
    marker = os.path.join(args.ckpt_dir, "latest")
    if not os.path.exists(marker):
        return 0
    with open(marker) as f:
        path = f.read().strip()
    state = {"model": model.state_dict(), "sparse_optim": model.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["sparse_optim"])
    trainer = torch.load(os.path.join(path, "trainer_state.pt"))
    dense_opt.load_state_dict(trainer["dense_optim"])
    sched.load_state_dict(trainer["sched"])
    return trainer["step"]


def make_loader(args):
    if args.synthetic:
        ds = RandomRecDataset(
            keys=DEFAULT_CAT_NAMES,
            batch_size=args.batch_size,
            hash_size=args.num_embeddings,
            ids_per_feature=1,
            num_dense=len(DEFAULT_INT_NAMES),
        )
        return DataLoader(ds, batch_size=None, batch_sampler=None, pin_memory=True, num_workers=0)
    return make_criteo_loader(args.data, "train", args.batch_size,
                              rank=dist.get_rank(), world_size=dist.get_world_size())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()

    model, dense_opt, sched = build(args, device)
    step = maybe_resume(args, model, dense_opt, sched)
    if rank == 0:
        print(f"starting at step {step}/{args.total_steps}", flush=True)

    # the fused sparse optimizer steps inside backward; the dense one is stepped here
    pipeline = TrainPipelineSparseDist(model, dense_opt, device)
    loader = make_loader(args)
    t0 = time.time()
    while step < args.total_steps:
        it = iter(loader)
        while step < args.total_steps:
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss.item():.5f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{100 / (time.time() - t0):.2f} it/s", flush=True)
                t0 = time.time()
            if step % args.ckpt_every == 0:
                save(args, model, dense_opt, sched, step)

    save(args, model, dense_opt, sched, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
