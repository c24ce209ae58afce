"""Multi-node CLIP ViT-B/16 on LAION-400M; checkpoints rotate on the shared /fsx volume.

sbatch wrapper runs, on each of 4 nodes:
    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_id $SLURM_JOB_ID --rdzv_backend c10d \
        --rdzv_endpoint $MASTER_ADDR:29500 14_multinode_b16_ckpt_rotation.py --logs /fsx/clip/logs
"""
import argparse
import glob
import logging
import math
import os
import time

import braceexpand
import torch
import torch.distributed as dist
import torch.nn.functional as F
import webdataset as wds
from torch.nn.parallel import DistributedDataParallel as DDP

import open_clip


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-data", default="/fsx/laion400m/{00000..41455}.tar")
    p.add_argument("--train-num-samples", type=int, default=400_000_000)
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--wd", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--logs", default="/fsx/clip/logs")
    p.add_argument("--name", default="b16_laion400m")
    p.add_argument("--save-frequency", type=int, default=1)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in the run dir")
    return p.parse_args()


def setup_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    return local_rank, dist.get_rank(), dist.get_world_size()


class ClipLoss(torch.nn.Module):
    def __init__(self, rank, world_size):
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def forward(self, img, txt, scale):
        gi = [torch.zeros_like(img) for _ in range(self.world_size)]
        gt = [torch.zeros_like(txt) for _ in range(self.world_size)]
        dist.all_gather(gi, img)
        dist.all_gather(gt, txt)
        gi[self.rank], gt[self.rank] = img, txt
        all_img, all_txt = torch.cat(gi), torch.cat(gt)
        li = scale * img @ all_txt.T
        lt = scale * txt @ all_img.T
        y = torch.arange(img.shape[0], device=img.device) + self.rank * img.shape[0]
        return (F.cross_entropy(li, y) + F.cross_entropy(lt, y)) / 2


def get_wds_loader(args, preprocess, tokenizer, world_size):
    urls = list(braceexpand.braceexpand(args.train_data))
    global_bs = args.batch_size * world_size
    n_batches = math.ceil(args.train_num_samples / global_bs)
    n_worker_batches = math.ceil(n_batches / args.workers)
    pipe = wds.DataPipeline(
        wds.ResampledShards(urls),
        wds.tarfile_to_samples(handler=wds.warn_and_continue),
        wds.shuffle(bufsize=5000, initial=1000),
        wds.decode("pilrgb", handler=wds.warn_and_continue),
        wds.rename(image="jpg;png;jpeg;webp", text="txt"),
        wds.map_dict(image=preprocess, text=lambda t: tokenizer(t)[0]),
        wds.to_tuple("image", "text"),
        wds.batched(args.batch_size, partial=False),
    ).with_epoch(n_worker_batches)
    loader = wds.WebLoader(pipe, batch_size=None, num_workers=args.workers, persistent_workers=True)
    return loader, n_worker_batches * args.workers


def save_checkpoint(ckpt_dir, epoch, model, optimizer, scaler, keep_last):
    state = {
        "epoch": epoch,
        "state_dict": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
    }
    path = os.path.join(ckpt_dir, f"epoch_{epoch}.pt")
    torch.save(state, path)
    ckpts = sorted(glob.glob(os.path.join(ckpt_dir, "epoch_*.pt")), key=os.path.getmtime)
    for old in ckpts[:-keep_last]:
        os.remove(old)
    return path


def find_latest(ckpt_dir):
    ckpts = glob.glob(os.path.join(ckpt_dir, "epoch_*.pt"))
    if not ckpts:
        return None
    return max(ckpts, key=lambda p: int(os.path.basename(p)[6:-3]))


def main():
    args = parse_args()
    local_rank, rank, world_size = setup_distributed()
    device = torch.device("cuda", local_rank)
    is_master = rank == 0
    logging.basicConfig(level=logging.INFO if is_master else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    run_dir = os.path.join(args.logs, args.name)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if is_master:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()

    model, preprocess_train, _ = open_clip.create_model_and_transforms(args.model, device=device)
    tokenizer = open_clip.get_tokenizer(args.model)

    exclude = lambda n, p: p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if exclude(n, p)], "weight_decay": 0.0},
         {"params": [p for n, p in model.named_parameters() if not exclude(n, p)], "weight_decay": args.wd}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        latest = find_latest(ckpt_dir)
        if latest is not None:
            ck = torch.load(latest, map_location="cpu")
            model.load_state_dict(ck["state_dict"])
            optimizer.load_state_dict(ck["optimizer"])
            scaler.load_state_dict(ck["scaler"])
            start_epoch = ck["epoch"]
            logging.info("resuming from %s", latest)

    model = DDP(model, device_ids=[local_rank])
    loader, steps_per_epoch = get_wds_loader(args, preprocess_train, tokenizer, world_size)
    total_steps = steps_per_epoch * args.epochs
    loss_fn = ClipLoss(rank, world_size)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * (step - args.warmup) / (total_steps - args.warmup)))

    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(loader):
            step = epoch * steps_per_epoch + i
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            images = images.to(device, non_blocking=True)
            texts = texts.to(device, non_blocking=True)
            with torch.autocast("cuda"):
                img, txt, scale = model(images, texts)
                loss = loss_fn(img, txt, scale)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            if is_master and i % 100 == 0:
                logging.info("epoch %d [%d/%d] loss %.4f scale %.2f lr %.2e %.1f samples/s/gpu", epoch, i,
                             steps_per_epoch, loss.item(), scale.item(), optimizer.param_groups[0]["lr"],
                             (i + 1) * args.batch_size / (time.time() - t0))

        completed = epoch + 1
        if completed % args.save_frequency == 0 or completed == args.epochs:
            path = save_checkpoint(ckpt_dir, completed, model, optimizer, scaler, args.keep_last)
            logging.info("saved %s", path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
