"""AANet stereo training on SceneFlow, multi-GPU with torch.distributed.

    torchrun --nproc_per_node=4 15_aanet_sceneflow.py --data_dir data/SceneFlow \
        --checkpoint_dir checkpoints/aanet_sceneflow --batch_size 16 --val_batch_size 16
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

import nets
from dataloader import dataloader, transforms
from utils import utils

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="train", type=str)
    parser.add_argument("--data_dir", default="data/SceneFlow", type=str)
    parser.add_argument("--dataset_name", default="SceneFlow", type=str)
    parser.add_argument("--checkpoint_dir", required=True, type=str)
    parser.add_argument("--pretrained_aanet", default=None, type=str)
    parser.add_argument("--batch_size", default=16, type=int, help="global")
    parser.add_argument("--val_batch_size", default=16, type=int, help="global")
    parser.add_argument("--img_height", default=288, type=int)
    parser.add_argument("--img_width", default=576, type=int)
    parser.add_argument("--val_img_height", default=576, type=int)
    parser.add_argument("--val_img_width", default=960, type=int)
    parser.add_argument("--num_workers", default=8, type=int)
    parser.add_argument("--max_disp", default=192, type=int)
    parser.add_argument("--feature_type", default="aanet", type=str)
    parser.add_argument("--num_downsample", default=2, type=int)
    parser.add_argument("--num_scales", default=3, type=int)
    parser.add_argument("--num_fusions", default=6, type=int)
    parser.add_argument("--num_stage_blocks", default=1, type=int)
    parser.add_argument("--num_deform_blocks", default=3, type=int)
    parser.add_argument("--refinement_type", default="stereodrnet", type=str)
    parser.add_argument("--learning_rate", default=1e-3, type=float)
    parser.add_argument("--weight_decay", default=1e-4, type=float)
    parser.add_argument("--milestones", default="20,30,40,50,60", type=str)
    parser.add_argument("--lr_decay_gamma", default=0.5, type=float)
    parser.add_argument("--max_epoch", default=64, type=int)
    parser.add_argument("--pyramid_loss_weight", default=[1 / 3, 2 / 3, 1.0, 1.0, 1.0], nargs="+", type=float)
    parser.add_argument("--highest_loss_only", action="store_true")
    parser.add_argument("--print_freq", default=100, type=int)
    parser.add_argument("--val_freq", default=10, type=int)
    parser.add_argument("--seed", default=326, type=int)
    return parser.parse_args()


def disp_pyramid_loss(pred_disp_pyramid, gt_disp, mask, weights, highest_only):
    disp_loss = 0
    if highest_only:
        pred_disp_pyramid = pred_disp_pyramid[-1:]
        weights = [1.0]
    for k, pred_disp in enumerate(pred_disp_pyramid):
        if pred_disp.size(-1) != gt_disp.size(-1):
            pred_disp = pred_disp.unsqueeze(1)
            pred_disp = F.interpolate(pred_disp, size=(gt_disp.size(-2), gt_disp.size(-1)),
                                      mode="bilinear", align_corners=False) * (gt_disp.size(-1) / pred_disp.size(-1))
            pred_disp = pred_disp.squeeze(1)
        curr_loss = F.smooth_l1_loss(pred_disp[mask], gt_disp[mask], reduction="mean")
        disp_loss += weights[k] * curr_loss
    return disp_loss


@torch.no_grad()
def validate(aanet, val_loader, device, max_disp):
    aanet.eval()
    epe_sum, d1_sum, thres3_sum, count = 0.0, 0.0, 0.0, 0
    for sample in val_loader:
        left = sample["left"].to(device)
        right = sample["right"].to(device)
        gt_disp = sample["disp"].to(device)
        mask = (gt_disp > 0) & (gt_disp < max_disp)
        if not mask.any():
            continue
        pred_disp = aanet(left, right)[-1]
        if pred_disp.size(-1) < gt_disp.size(-1):
            pred_disp = F.interpolate(pred_disp.unsqueeze(1), size=gt_disp.shape[-2:], mode="bilinear",
                                      align_corners=False).squeeze(1) * (gt_disp.size(-1) / pred_disp.size(-1))
        err = (pred_disp - gt_disp).abs()
        epe_sum += err[mask].mean().item()
        d1_sum += ((err > 3) & (err / gt_disp.clamp(min=1e-6) > 0.05))[mask].float().mean().item()
        thres3_sum += (err > 3)[mask].float().mean().item()
        count += 1

    stats = torch.tensor([epe_sum, d1_sum, thres3_sum, count], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    aanet.train()
    epe, d1, thres3, n = stats.tolist()
    return {"epe": epe / max(n, 1), "d1": d1 / max(n, 1), "thres3": thres3 / max(n, 1)}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)
    torch.backends.cudnn.benchmark = True

    if rank == 0:
        utils.check_path(args.checkpoint_dir)
        utils.save_args(args)

    train_transform = transforms.Compose([
        transforms.RandomCrop(args.img_height, args.img_width),
        transforms.RandomColor(),
        transforms.RandomVerticalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
    ])
    val_transform = transforms.Compose([
        transforms.RandomCrop(args.val_img_height, args.val_img_width, validate=True),
        transforms.ToTensor(),
        transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
    ])
    train_data = dataloader.StereoDataset(data_dir=args.data_dir, dataset_name=args.dataset_name,
                                          mode="train", transform=train_transform)
    val_data = dataloader.StereoDataset(data_dir=args.data_dir, dataset_name=args.dataset_name,
                                        mode="val", transform=val_transform)
    train_sampler = DistributedSampler(train_data, shuffle=True)
    train_loader = DataLoader(train_data, batch_size=args.batch_size // world_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_subset = torch.utils.data.Subset(val_data, range(rank, len(val_data), world_size))
    val_loader = DataLoader(val_subset, batch_size=args.val_batch_size // world_size, shuffle=False,
                            num_workers=args.num_workers, pin_memory=True, drop_last=False)

    aanet = nets.AANet(args.max_disp,
                       num_downsample=args.num_downsample,
                       feature_type=args.feature_type,
                       no_feature_mdconv=False,
                       feature_pyramid_network=True,
                       num_scales=args.num_scales,
                       num_fusions=args.num_fusions,
                       num_stage_blocks=args.num_stage_blocks,
                       num_deform_blocks=args.num_deform_blocks,
                       refinement_type=args.refinement_type)
    if args.pretrained_aanet is not None:
        utils.load_pretrained_net(aanet, args.pretrained_aanet, no_strict=True)
    aanet = nn.SyncBatchNorm.convert_sync_batchnorm(aanet).to(device)
    model = DDP(aanet, device_ids=[local_rank], output_device=local_rank)

    specific_params = [p for n, p in model.module.named_parameters() if "offset_conv" in n or "deformable" in n]
    base_params = [p for n, p in model.module.named_parameters() if not ("offset_conv" in n or "deformable" in n)]
    optimizer = torch.optim.Adam([{"params": base_params, "lr": args.learning_rate},
                                  {"params": specific_params, "lr": args.learning_rate * 0.1}],
                                 weight_decay=args.weight_decay)
    milestones = [int(step) for step in args.milestones.split(",")]
    lr_scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones,
                                                        gamma=args.lr_decay_gamma)

    writer = SummaryWriter(args.checkpoint_dir) if rank == 0 else None
    best_epe = float("inf")
    global_step = 0
    for epoch in range(args.max_epoch):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, sample in enumerate(train_loader):
            left = sample["left"].to(device, non_blocking=True)
            right = sample["right"].to(device, non_blocking=True)
            gt_disp = sample["disp"].to(device, non_blocking=True)
            mask = (gt_disp > 0) & (gt_disp < args.max_disp)

            pred_disp_pyramid = model(left, right)
            loss = disp_pyramid_loss(pred_disp_pyramid, gt_disp, mask, args.pyramid_loss_weight,
                                     args.highest_loss_only)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            global_step += 1

            if global_step % args.print_freq == 0:
                l = loss.detach().clone()
                dist.all_reduce(l)
                if rank == 0:
                    writer.add_scalar("train/disp_loss", l.item() / world_size, global_step)
                    print("[%d/%d] step %d loss %.3f time %.2fs/it" % (
                        epoch, args.max_epoch, global_step, l.item() / world_size,
                        (time.time() - t0) / (i + 1)), flush=True)
        lr_scheduler.step()

        if (epoch + 1) % args.val_freq == 0 or epoch + 1 == args.max_epoch:
            results = validate(model.module, val_loader, device, args.max_disp)
            if rank == 0:
                for k, v in results.items():
                    writer.add_scalar("val/" + k, v, epoch)
                print("epoch %d val %s" % (epoch, json.dumps(results)), flush=True)
                state = {"epoch": epoch, "state_dict": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "epe": results["epe"]}
                torch.save(state, os.path.join(args.checkpoint_dir, "aanet_latest.pth"))
                if results["epe"] < best_epe:
                    best_epe = results["epe"]
                    torch.save(state, os.path.join(args.checkpoint_dir, "aanet_best.pth"))
            dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
