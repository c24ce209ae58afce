from __future__ import absolute_import, division, print_function, unicode_literals

import argparse
import datetime
import json
import logging
import os
import random
import time

import clip
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize

logger = logging.getLogger(__name__)


def get_args(description="CLIP4Clip on ActivityNet Captions (paragraph-to-video)"):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--do_train", action="store_true")
    parser.add_argument("--do_eval", action="store_true")
    parser.add_argument("--data_path", type=str, default="data/activitynet")
    parser.add_argument("--features_path", type=str, default="data/activitynet/videos_fps3")
    parser.add_argument("--num_thread_reader", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--coef_lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=64, help="global batch")
    parser.add_argument("--batch_size_val", type=int, default=16)
    parser.add_argument("--max_words", type=int, default=64)
    parser.add_argument("--max_frames", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--pretrained_clip_name", default="ViT-B/32", type=str)
    parser.add_argument("--local_rank", default=0, type=int, help="distributed training")
    parser.add_argument("--world_size", default=0, type=int, help="distributed training")
    parser.add_argument("--n_display", type=int, default=100)
    args = parser.parse_args()
    if not args.do_train and not args.do_eval:
        raise ValueError("At least one of `do_train` or `do_eval` must be True.")
    return args


def set_seed_logger(args):
    random.seed(args.seed)
    os.environ["PYTHONHASHSEED"] = str(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.cuda.manual_seed_all(args.seed)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True

    world_size = torch.distributed.get_world_size()
    args.world_size = world_size
    args.rank = torch.distributed.get_rank()
    if args.rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    logging.basicConfig(level=logging.INFO if args.rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(levelname)s - %(message)s")
    return args


class ActivityNetParagraph(Dataset):
    def __init__(self, data_path, features_path, split, max_words, max_frames):
        with open(os.path.join(data_path, f"{split}.json")) as f:
            ann = json.load(f)
        self.items = sorted((vid, " ".join(s.strip() for s in v["sentences"])) for vid, v in ann.items())
        self.features_path = features_path
        self.max_words, self.max_frames = max_words, max_frames
        self.transform = Compose([Resize(224, interpolation=InterpolationMode.BICUBIC, antialias=True),
                                  CenterCrop(224),
                                  Normalize((0.48145466, 0.4578275, 0.40821073),
                                            (0.26862954, 0.26130258, 0.27577711))])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        vid, text = self.items[idx]
        tokens = clip.tokenize(text, context_length=77, truncate=True)[0]
        vr = VideoReader(os.path.join(self.features_path, vid + ".mp4"), ctx=cpu(0), num_threads=1)
        n = len(vr)
        ids = np.linspace(0, n - 1, min(n, self.max_frames)).astype(int)
        frames = torch.from_numpy(vr.get_batch(ids.tolist()).asnumpy()).permute(0, 3, 1, 2).float() / 255.0
        video = torch.zeros(self.max_frames, 3, 224, 224)
        video[: len(ids)] = self.transform(frames)
        video_mask = torch.zeros(self.max_frames, dtype=torch.long)
        video_mask[: len(ids)] = 1
        return tokens, video, video_mask


class CLIP4Clip(nn.Module):
    def __init__(self, clip_name):
        super().__init__()
        self.clip, _ = clip.load(clip_name, device="cpu", jit=False)
        self.clip.float()

    def get_sequence_output(self, tokens):
        return self.clip.encode_text(tokens)

    def get_visual_output(self, video, video_mask):
        b, t = video.shape[:2]
        out = self.clip.encode_image(video.view(b * t, *video.shape[2:])).view(b, t, -1)
        m = video_mask.unsqueeze(-1).float()
        return (out * m).sum(1) / m.sum(1).clamp(min=1.0)

    def forward(self, tokens, video, video_mask):
        t = F.normalize(self.get_sequence_output(tokens), dim=-1)
        v = F.normalize(self.get_visual_output(video, video_mask), dim=-1)
        return t, v, self.clip.logit_scale.exp()


class AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, args):
        output = [torch.empty_like(tensor) for _ in range(args.world_size)]
        torch.distributed.all_gather(output, tensor)
        ctx.rank, ctx.batch_size = args.rank, tensor.shape[0]
        return torch.cat(output, dim=0)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output[ctx.batch_size * ctx.rank: ctx.batch_size * (ctx.rank + 1)], None


def train_epoch(epoch, args, model, loader, device, optimizer, scheduler, global_step):
    model.train()
    total_loss, start = 0.0, time.time()
    for step, batch in enumerate(loader):
        tokens, video, video_mask = (b.to(device, non_blocking=True) for b in batch)
        t, v, scale = model(tokens, video, video_mask)
        t, v = AllGather.apply(t, args), AllGather.apply(v, args)
        sim = scale * t @ v.t()
        labels = torch.arange(sim.shape[0], device=device)
        loss = (F.cross_entropy(sim, labels) + F.cross_entropy(sim.t(), labels)) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        torch.clamp_(model.module.clip.logit_scale.data, max=np.log(100))
        global_step += 1
        total_loss += loss.item()
        if global_step % args.n_display == 0 and args.rank == 0:
            logger.info("Epoch: %d/%s, Step: %d/%d, Lr: %s, Loss: %f, Time/step: %f", epoch + 1, args.epochs,
                        step + 1, len(loader), "-".join(f"{lr:.9f}" for lr in scheduler.get_last_lr()),
                        loss.item(), (time.time() - start) / args.n_display)
            start = time.time()
    return total_loss / len(loader), global_step


@torch.no_grad()
def eval_epoch(args, model, loader, device):
    model.eval()
    t_all, v_all = [], []
    for tokens, video, video_mask in loader:
        t_all.append(F.normalize(model.get_sequence_output(tokens.to(device)), dim=-1))
        v_all.append(F.normalize(model.get_visual_output(video.to(device), video_mask.to(device)), dim=-1))
    sim = (torch.cat(t_all) @ torch.cat(v_all).t()).cpu().numpy()
    sx = np.sort(-sim, axis=1)
    d = np.diag(-sim)[:, None]
    ind = np.where(sx - d == 0)[1]
    metrics = {"R1": float(np.sum(ind == 0)) * 100 / len(ind), "R5": float(np.sum(ind < 5)) * 100 / len(ind),
               "R10": float(np.sum(ind < 10)) * 100 / len(ind), "MR": np.median(ind) + 1}
    logger.info("Text-to-Video: >>> R@1: %.1f - R@5: %.1f - R@10: %.1f - Median R: %.1f",
                metrics["R1"], metrics["R5"], metrics["R10"], metrics["MR"])
    return metrics["R1"]


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    torch.distributed.init_process_group(backend="nccl", timeout=datetime.timedelta(hours=2))
    args = set_seed_logger(args)
    device = torch.device("cuda", args.local_rank)

    model = CLIP4Clip(args.pretrained_clip_name).to(device)
    test_data = ActivityNetParagraph(args.data_path, args.features_path, "val_1", args.max_words, args.max_frames)
    test_loader = DataLoader(test_data, batch_size=args.batch_size_val, shuffle=False,
                             num_workers=args.num_thread_reader)

    if args.do_train:
        train_data = ActivityNetParagraph(args.data_path, args.features_path, "train", args.max_words,
                                          args.max_frames)
        sampler = DistributedSampler(train_data)
        train_loader = DataLoader(train_data, batch_size=args.batch_size // args.world_size, sampler=sampler,
                                  num_workers=args.num_thread_reader, pin_memory=True, drop_last=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * args.coef_lr, betas=(0.9, 0.98),
                                      eps=1e-6, weight_decay=0.2)
        total_steps = len(train_loader) * args.epochs
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr * args.coef_lr,
                                                        total_steps=total_steps, pct_start=0.1)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank],
                                                          output_device=args.local_rank)
        best, global_step = 0.0, 0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            tr_loss, global_step = train_epoch(epoch, args, model, train_loader, device, optimizer, scheduler,
                                               global_step)
            if args.rank == 0:
                logger.info("Epoch %d/%s Finished, Train Loss: %f", epoch + 1, args.epochs, tr_loss)
                path = os.path.join(args.output_dir, f"pytorch_model.bin.{epoch}")
                torch.save(model.module.state_dict(), path)
                r1 = eval_epoch(args, model.module, test_loader, device)
                if r1 > best:
                    best = r1
                    torch.save(model.module.state_dict(), os.path.join(args.output_dir, "pytorch_model.bin.best"))
                logger.info("The best R1 is: %.4f", best)
            torch.distributed.barrier()
    elif args.do_eval and args.rank == 0:
        eval_epoch(args, model, test_loader, device)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
