"""GMFlow fine-tuning on KITTI (2012+2015 mixed with HD1K), multi-GPU with torchrun.

torchrun --nproc_per_node=8 main_kitti.py --resume pretrained/gmflow_with_refine_sintel.pth \
    --checkpoint_dir checkpoints/kitti-gmflow --batch_size 16 --num_steps 50000 --padding_factor 32 \
    --upsample_factor 4 --num_scales 2 --attn_splits_list 2 8 --corr_radius_list -1 4 --prop_radius_list -1 1 \
    --with_speed_metric
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader
from torch.utils.tensorboard import SummaryWriter

from data import HD1K, KITTI
from evaluate import validate_kitti
from gmflow.gmflow import GMFlow
from loss import flow_loss_func
from utils.utils import count_parameters


def get_args_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint_dir", default="tmp", type=str)
    parser.add_argument("--image_size", default=[320, 896], type=int, nargs="+")
    parser.add_argument("--padding_factor", default=16, type=int)
    parser.add_argument("--max_flow", default=400, type=int)
    parser.add_argument("--lr", default=2e-4, type=float)
    parser.add_argument("--batch_size", default=16, type=int, help="global batch size")
    parser.add_argument("--num_workers", default=4, type=int)
    parser.add_argument("--weight_decay", default=1e-4, type=float)
    parser.add_argument("--grad_clip", default=1.0, type=float)
    parser.add_argument("--num_steps", default=50000, type=int)
    parser.add_argument("--seed", default=326, type=int)
    parser.add_argument("--summary_freq", default=100, type=int)
    parser.add_argument("--val_freq", default=5000, type=int)
    parser.add_argument("--save_ckpt_freq", default=10000, type=int)
    parser.add_argument("--resume", default=None, type=str)
    parser.add_argument("--no_resume_optimizer", action="store_true")
    parser.add_argument("--num_scales", default=1, type=int)
    parser.add_argument("--feature_channels", default=128, type=int)
    parser.add_argument("--upsample_factor", default=8, type=int)
    parser.add_argument("--num_transformer_layers", default=6, type=int)
    parser.add_argument("--num_head", default=1, type=int)
    parser.add_argument("--attention_type", default="swin", type=str)
    parser.add_argument("--ffn_dim_expansion", default=4, type=int)
    parser.add_argument("--attn_splits_list", default=[2], type=int, nargs="+")
    parser.add_argument("--corr_radius_list", default=[-1], type=int, nargs="+")
    parser.add_argument("--prop_radius_list", default=[-1], type=int, nargs="+")
    parser.add_argument("--gamma", default=0.9, type=float)
    parser.add_argument("--with_speed_metric", action="store_true")
    return parser


def build_train_dataset(args):
    aug_params = {"crop_size": args.image_size, "min_scale": -0.2, "max_scale": 0.4, "do_flip": True}
    kitti15 = KITTI(aug_params, split="training")
    kitti12 = KITTI(aug_params, split="training", root="datasets/KITTI12")
    hd1k = HD1K({"crop_size": args.image_size, "min_scale": -0.5, "max_scale": 0.2, "do_flip": True})
    return ConcatDataset([kitti15] * 10 + [kitti12] * 10 + [hd1k])


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    seed = args.seed
    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        with open(os.path.join(args.checkpoint_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=4, sort_keys=False)

    model = GMFlow(feature_channels=args.feature_channels, num_scales=args.num_scales,
                   upsample_factor=args.upsample_factor, num_head=args.num_head,
                   attention_type=args.attention_type, ffn_dim_expansion=args.ffn_dim_expansion,
                   num_transformer_layers=args.num_transformer_layers).to(device)
    if rank == 0:
        print("Number of params:", count_parameters(model))

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    start_step = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu")
        weights = checkpoint["model"] if "model" in checkpoint else checkpoint
        model.load_state_dict(weights, strict=False)
        if "optimizer" in checkpoint and "step" in checkpoint and not args.no_resume_optimizer:
            optimizer.load_state_dict(checkpoint["optimizer"])
            start_step = checkpoint["step"]
        if rank == 0:
            print("resumed from %s at step %d" % (args.resume, start_step))

    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    model_without_ddp = model.module

    train_dataset = build_train_dataset(args)
    if rank == 0:
        print("Number of training images:", len(train_dataset))
    assert args.batch_size % world_size == 0
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size // world_size, shuffle=True,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)

    last_epoch = start_step if args.resume and start_step > 0 else -1
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, args.num_steps + 10, pct_start=0.05,
                                                       cycle_momentum=False, anneal_strategy="cos",
                                                       last_epoch=last_epoch)
    summary_writer = SummaryWriter(args.checkpoint_dir) if rank == 0 else None

    total_steps = start_step
    epoch = 0
    meter = torch.zeros(4, device=device)
    t0 = time.time()
    while total_steps < args.num_steps:
        model.train()
        for sample in train_loader:
            img1, img2, flow_gt, valid = [x.to(device, non_blocking=True) for x in sample]
            results_dict = model(img1, img2, attn_splits_list=args.attn_splits_list,
                                 corr_radius_list=args.corr_radius_list,
                                 prop_radius_list=args.prop_radius_list)
            flow_preds = results_dict["flow_preds"]
            loss, metrics = flow_loss_func(flow_preds, flow_gt, valid, gamma=args.gamma, max_flow=args.max_flow)

            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            lr_scheduler.step()
            total_steps += 1

            meter += torch.tensor([loss.item(), metrics["epe"], metrics["1px"], 1.0], device=device)
            if total_steps % args.summary_freq == 0:
                dist.all_reduce(meter)
                if rank == 0:
                    n = meter[3].item()
                    msg = "step %d  loss %.3f  epe %.3f  1px %.3f  lr %.2e  %.2fs/it" % (
                        total_steps, meter[0].item() / n, meter[1].item() / n, meter[2].item() / n,
                        lr_scheduler.get_last_lr()[0], (time.time() - t0) / args.summary_freq)
                    print(msg)
                    summary_writer.add_scalar("train/loss", meter[0].item() / n, total_steps)
                    summary_writer.add_scalar("train/epe", meter[1].item() / n, total_steps)
                meter.zero_()
                t0 = time.time()

            if total_steps % args.save_ckpt_freq == 0 and rank == 0:
                torch.save({"model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": total_steps, "epoch": epoch},
                           os.path.join(args.checkpoint_dir, "step_%06d.pth" % total_steps))

            if total_steps % args.val_freq == 0:
                # KITTI validation is cheap (200 pairs); run it on rank 0 with the bare model
                if rank == 0:
                    val_results = validate_kitti(model_without_ddp, padding_factor=args.padding_factor,
                                                 with_speed_metric=args.with_speed_metric,
                                                 attn_splits_list=args.attn_splits_list,
                                                 corr_radius_list=args.corr_radius_list,
                                                 prop_radius_list=args.prop_radius_list)
                    for k, v in val_results.items():
                        summary_writer.add_scalar("val/" + k, v, total_steps)
                    with open(os.path.join(args.checkpoint_dir, "val_results.txt"), "a") as f:
                        f.write("step: %06d %s\n" % (total_steps, json.dumps(val_results)))
                model.train()
                dist.barrier()

            if total_steps >= args.num_steps:
                break
        epoch += 1

    if rank == 0:
        torch.save({"model": model_without_ddp.state_dict()}, os.path.join(args.checkpoint_dir, "step_final.pth"))
        summary_writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = get_args_parser()
    main(parser.parse_args())
