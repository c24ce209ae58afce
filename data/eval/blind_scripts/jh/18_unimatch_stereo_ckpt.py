"""UniMatch (GMStereo) training on SceneFlow with refinement, DDP via torchrun.

    torchrun --nproc_per_node=8 --master_port=29502 18_unimatch_stereo_ckpt.py \
        --stage sceneflow --checkpoint_dir checkpoints_stereo/sceneflow-gmstereo
"""
import argparse
import datetime
import json
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from dataloader.stereo.datasets import build_dataset
from unimatch.unimatch import UniMatch
from evaluate_stereo import validate_things


def get_args_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", default="tmp", type=str)
    parser.add_argument("--stage", default="sceneflow", type=str, nargs="+")
    parser.add_argument("--max_disp", default=400, type=int)
    parser.add_argument("--val_dataset", default=["things"], type=str, nargs="+")
    parser.add_argument("--img_height", default=288, type=int)
    parser.add_argument("--img_width", default=512, type=int)
    parser.add_argument("--padding_factor", default=32, type=int)
    parser.add_argument("--lr", default=4e-4, type=float)
    parser.add_argument("--batch_size", default=8, type=int, help="total over all GPUs")
    parser.add_argument("--num_workers", default=8, type=int)
    parser.add_argument("--weight_decay", default=1e-4, type=float)
    parser.add_argument("--seed", default=326, type=int)
    parser.add_argument("--resume", default=None, type=str)
    parser.add_argument("--no_resume_optimizer", action="store_true")
    parser.add_argument("--num_scales", default=2, type=int)
    parser.add_argument("--feature_channels", default=128, type=int)
    parser.add_argument("--upsample_factor", default=4, type=int)
    parser.add_argument("--num_head", default=1, type=int)
    parser.add_argument("--ffn_dim_expansion", default=4, type=int)
    parser.add_argument("--num_transformer_layers", default=6, type=int)
    parser.add_argument("--reg_refine", action="store_true")
    parser.add_argument("--attn_splits_list", default=[2, 8], type=int, nargs="+")
    parser.add_argument("--corr_radius_list", default=[-1, 4], type=int, nargs="+")
    parser.add_argument("--prop_radius_list", default=[-1, 1], type=int, nargs="+")
    parser.add_argument("--num_reg_refine", default=3, type=int)
    parser.add_argument("--gamma", default=0.9, type=float)
    parser.add_argument("--summary_freq", default=100, type=int)
    parser.add_argument("--val_freq", default=10000, type=int)
    parser.add_argument("--save_ckpt_freq", default=10000, type=int)
    parser.add_argument("--save_latest_ckpt_freq", default=1000, type=int)
    parser.add_argument("--num_steps", default=100000, type=int)
    return parser


def disparity_loss(disp_preds, disp_gt, mask, gamma):
    n = len(disp_preds)
    loss = 0.0
    for i in range(n):
        w = gamma ** (n - 1 - i)
        loss = loss + w * F.smooth_l1_loss(disp_preds[i][mask], disp_gt[mask], reduction="mean")
    return loss


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 validates on the full Things test split while the others wait in the next all-reduce
    dist.init_process_group(backend="nccl", init_method="env://", timeout=datetime.timedelta(minutes=90))
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    seed = args.seed + rank
    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        with open(os.path.join(args.checkpoint_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    dist.barrier()

    model = UniMatch(feature_channels=args.feature_channels, num_scales=args.num_scales,
                     upsample_factor=args.upsample_factor, num_head=args.num_head,
                     ffn_dim_expansion=args.ffn_dim_expansion,
                     num_transformer_layers=args.num_transformer_layers,
                     reg_refine=args.reg_refine, task="stereo").to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)
    model_without_ddp = model.module

    optimizer = torch.optim.AdamW(model_without_ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    start_step, start_epoch = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model_without_ddp.load_state_dict(ckpt["model"], strict=True)
        if "optimizer" in ckpt and not args.no_resume_optimizer:
            optimizer.load_state_dict(ckpt["optimizer"])
            start_step, start_epoch = ckpt["step"], ckpt["epoch"]

    train_data = build_dataset(args)
    per_gpu_bs = args.batch_size // world_size
    sampler = DistributedSampler(train_data, num_replicas=world_size, rank=rank)
    train_loader = DataLoader(train_data, batch_size=per_gpu_bs, shuffle=False, sampler=sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)

    last_epoch = start_step if args.resume and start_step > 0 else -1
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 10, pct_start=0.05,
                                                       cycle_momentum=False, anneal_strategy="cos",
                                                       last_epoch=last_epoch)
    summary_writer = SummaryWriter(args.checkpoint_dir) if rank == 0 else None

    total_steps = start_step
    epoch = start_epoch
    print_time = time.time()
    while total_steps < args.num_steps:
        model.train()
        sampler.set_epoch(epoch)
        for sample in train_loader:
            left = sample["left"].to(device, non_blocking=True)
            right = sample["right"].to(device, non_blocking=True)
            gt_disp = sample["disp"].to(device, non_blocking=True)
            mask = (gt_disp > 0) & (gt_disp < args.max_disp)

            pred_disps = model(left, right, attn_type="self_swin2d_cross_1d",
                               attn_splits_list=args.attn_splits_list,
                               corr_radius_list=args.corr_radius_list,
                               prop_radius_list=args.prop_radius_list,
                               num_reg_refine=args.num_reg_refine, task="stereo")["flow_preds"]
            # predictions at 1/8, 1/4 and the refined full resolution; all upsampled to gt
            pred_disps = [F.interpolate(d.unsqueeze(1), size=gt_disp.shape[-2:], mode="bilinear",
                                        align_corners=True).squeeze(1) * (gt_disp.shape[-1] / d.shape[-1])
                          for d in pred_disps]
            loss = disparity_loss(pred_disps, gt_disp, mask, args.gamma)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            total_steps += 1

            if rank == 0 and total_steps % args.summary_freq == 0:
                epe = (pred_disps[-1] - gt_disp).abs()[mask].mean().item()
                summary_writer.add_scalar("train/loss", loss.item(), total_steps)
                summary_writer.add_scalar("train/epe", epe, total_steps)
                summary_writer.add_scalar("train/lr", lr_scheduler.get_last_lr()[0], total_steps)
                print(f"step {total_steps} loss {loss.item():.3f} epe {epe:.3f} "
                      f"({(time.time() - print_time) / args.summary_freq:.2f}s/it)", flush=True)
                print_time = time.time()

            if total_steps % args.save_latest_ckpt_freq == 0:
                checkpoint_path = os.path.join(args.checkpoint_dir, "checkpoint_latest.pth")
                torch.save({"model": model_without_ddp.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "step": total_steps, "epoch": epoch}, checkpoint_path)
                if total_steps % args.save_ckpt_freq == 0:
                    shutil.copyfile(checkpoint_path,
                                    os.path.join(args.checkpoint_dir, f"step_{total_steps:06d}.pth"))

            if total_steps % args.val_freq == 0 and rank == 0:
                val_results = validate_things(model_without_ddp, max_disp=args.max_disp,
                                              padding_factor=args.padding_factor,
                                              attn_type="self_swin2d_cross_1d",
                                              attn_splits_list=args.attn_splits_list,
                                              corr_radius_list=args.corr_radius_list,
                                              prop_radius_list=args.prop_radius_list,
                                              num_reg_refine=args.num_reg_refine)
                for k, v in val_results.items():
                    summary_writer.add_scalar(f"val/{k}", v, total_steps)
                with open(os.path.join(args.checkpoint_dir, "val_results.txt"), "a") as f:
                    f.write(f"step {total_steps}: {json.dumps(val_results)}\n")
                model.train()

            if total_steps >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model": model_without_ddp.state_dict()},
                   os.path.join(args.checkpoint_dir, "step_final.pth"))
        summary_writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
