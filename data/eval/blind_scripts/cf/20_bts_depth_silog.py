"""Supervised monocular depth (BTS-style) on the KITTI Eigen split with the scale-invariant log loss.

    torchrun --nproc_per_node=4 bts_main.py --data_path /data/kitti_raw --gt_path /data/kitti_depth \
        --filenames_file train_test_inputs/eigen_train_files_with_gt.txt --batch_size 4 --num_epochs 50
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from bts import BtsModel
from bts_dataloader import DataLoadPreprocess, ToTensor

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def get_args():
    p = argparse.ArgumentParser("BTS PyTorch implementation.", fromfile_prefix_chars="@")
    p.add_argument("--model_name", default="bts_eigen_v2_pytorch")
    p.add_argument("--encoder", default="densenet161_bts")
    p.add_argument("--dataset", default="kitti")
    p.add_argument("--data_path", required=True)
    p.add_argument("--gt_path", required=True)
    p.add_argument("--filenames_file", required=True)
    p.add_argument("--filenames_file_eval", default="train_test_inputs/eigen_test_files_with_gt.txt")
    p.add_argument("--input_height", type=int, default=352)
    p.add_argument("--input_width", type=int, default=704)
    p.add_argument("--max_depth", type=float, default=80)
    p.add_argument("--min_depth_eval", type=float, default=1e-3)
    p.add_argument("--max_depth_eval", type=float, default=80)
    p.add_argument("--garg_crop", action="store_true", default=True)
    p.add_argument("--do_kb_crop", action="store_true", default=True)
    p.add_argument("--do_random_rotate", action="store_true", default=True)
    p.add_argument("--degree", type=float, default=1.0)
    p.add_argument("--bts_size", type=int, default=512)
    p.add_argument("--variance_focus", type=float, default=0.85)
    p.add_argument("--batch_size", type=int, default=4, help="per GPU")
    p.add_argument("--num_epochs", type=int, default=50)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--end_learning_rate", type=float, default=-1)
    p.add_argument("--weight_decay", type=float, default=1e-2)
    p.add_argument("--adam_eps", type=float, default=1e-6)
    p.add_argument("--num_threads", type=int, default=4)
    p.add_argument("--log_directory", default="./models")
    p.add_argument("--log_freq", type=int, default=100)
    p.add_argument("--eval_freq", type=int, default=2000)
    p.add_argument("--checkpoint_path", default="")
    p.add_argument("--fix_first_conv_blocks", action="store_true")
    return p.parse_args()


class SILogLoss(nn.Module):
    def __init__(self, variance_focus):
        super().__init__()
        self.variance_focus = variance_focus

    def forward(self, depth_est, depth_gt, mask):
        d = torch.log(depth_est[mask]) - torch.log(depth_gt[mask])
        return torch.sqrt((d ** 2).mean() - self.variance_focus * (d.mean() ** 2)) * 10.0


def compute_error_sums(gt, pred):
    thresh = torch.maximum(gt / pred, pred / gt)
    return torch.stack([
        (thresh < 1.25).double().sum(), (thresh < 1.25 ** 2).double().sum(), (thresh < 1.25 ** 3).double().sum(),
        (torch.abs(gt - pred) / gt).double().sum(), (((gt - pred) ** 2) / gt).double().sum(),
        ((gt - pred) ** 2).double().sum(), ((torch.log(gt) - torch.log(pred)) ** 2).double().sum(),
        torch.tensor(gt.numel(), dtype=torch.float64, device=gt.device)])


@torch.no_grad()
def online_eval(model, loader, args):
    sums = torch.zeros(8, dtype=torch.float64, device=DEVICE)
    for sample in loader:
        image = sample["image"].to(DEVICE, non_blocking=True)
        gt_depth = sample["depth"].to(DEVICE)
        if not sample["has_valid_depth"].all():
            continue
        _, _, _, _, pred_depth = model(image, sample["focal"].to(DEVICE))
        pred_depth, gt_depth = pred_depth[0, 0], gt_depth[0, :, :, 0]
        pred_depth = pred_depth.clamp(args.min_depth_eval, args.max_depth_eval)
        valid = (gt_depth > args.min_depth_eval) & (gt_depth < args.max_depth_eval)
        if args.garg_crop:
            h, w = gt_depth.shape
            crop = torch.zeros_like(valid)
            crop[int(0.40810811 * h):int(0.99189189 * h), int(0.03594771 * w):int(0.96405229 * w)] = True
            valid = valid & crop
        sums += compute_error_sums(gt_depth[valid], pred_depth[valid])
    dist.all_reduce(sums)
    n = sums[7]
    d1, d2, d3, abs_rel, sq_rel, sq, log_sq = (sums[:7] / n).tolist()
    return {"d1": d1, "d2": d2, "d3": d3, "abs_rel": abs_rel, "sq_rel": sq_rel,
            "rms": float(np.sqrt(sq)), "log_rms": float(np.sqrt(log_sq))}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    model = BtsModel(args)
    model.decoder.apply(lambda m: nn.init.xavier_uniform_(m.weight) if isinstance(m, nn.Conv2d) else None)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.cuda(local_rank)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=False)

    optimizer = torch.optim.AdamW([
        {"params": model.module.encoder.parameters(), "weight_decay": args.weight_decay},
        {"params": model.module.decoder.parameters(), "weight_decay": 0}], lr=args.learning_rate, eps=args.adam_eps)

    global_step = 0
    if args.checkpoint_path:
        ckpt = torch.load(args.checkpoint_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        global_step = ckpt["global_step"]

    train_set = DataLoadPreprocess(args, "train", transform=ToTensor("train"))
    eval_set = DataLoadPreprocess(args, "online_eval", transform=ToTensor("online_eval"))
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=args.num_threads,
                        pin_memory=True, drop_last=True)
    eval_loader = DataLoader(Subset(eval_set, range(rank, len(eval_set), world)), 1, shuffle=False,
                             num_workers=1, pin_memory=True)

    silog = SILogLoss(args.variance_focus)
    end_lr = args.end_learning_rate if args.end_learning_rate != -1 else 0.1 * args.learning_rate
    num_total_steps = args.num_epochs * len(loader)
    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.log_directory, args.model_name), exist_ok=True)
        writer = SummaryWriter(os.path.join(args.log_directory, args.model_name, "summaries"), flush_secs=30)

    best_abs_rel = 1e9
    epoch = global_step // len(loader)
    while epoch < args.num_epochs:
        sampler.set_epoch(epoch)
        model.train()
        for sample in loader:
            t0 = time.time()
            image = sample["image"].to(DEVICE, non_blocking=True)
            focal = sample["focal"].to(DEVICE, non_blocking=True)
            depth_gt = sample["depth"].to(DEVICE, non_blocking=True)

            _, _, _, _, depth_est = model(image, focal)
            mask = depth_gt > 1.0
            loss = silog(depth_est, depth_gt, mask)

            optimizer.zero_grad()
            loss.backward()
            current_lr = (args.learning_rate - end_lr) * (1 - global_step / num_total_steps) ** 0.9 + end_lr
            for g in optimizer.param_groups:
                g["lr"] = current_lr
            optimizer.step()
            global_step += 1

            if global_step % args.log_freq == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    print("[epoch {}][step {}/{}] silog {:.4f} lr {:.2e} {:.2f}s/it".format(
                        epoch, global_step, num_total_steps, l.item() / world, current_lr, time.time() - t0))
                    writer.add_scalar("silog_loss", l.item() / world, global_step)
                    writer.add_scalar("learning_rate", current_lr, global_step)

            if global_step % args.eval_freq == 0:
                model.eval()
                metrics = online_eval(model.module, eval_loader, args)
                model.train()
                if rank == 0:
                    print("eval @ {}: {}".format(global_step, metrics))
                    for k, v in metrics.items():
                        writer.add_scalar("eval/" + k, v, global_step)
                    state = {"global_step": global_step, "model": model.module.state_dict(),
                             "optimizer": optimizer.state_dict()}
                    torch.save(state, os.path.join(args.log_directory, args.model_name, "model_last"))
                    if metrics["abs_rel"] < best_abs_rel:
                        best_abs_rel = metrics["abs_rel"]
                        torch.save(state, os.path.join(args.log_directory, args.model_name, "model_best"))
                dist.barrier()
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
