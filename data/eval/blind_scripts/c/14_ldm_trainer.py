# -*- coding: utf-8 -*-
"""
Latent Diffusion 无条件生成 (人脸 / 动漫头像), VAE 冻结, 只训练 UNet
    torchrun --nproc_per_node=8 train_ldm.py --config configs/ldm_ffhq256.yaml
"""
import os
import glob
import time
import argparse
import logging

import yaml
import torch
import torch.nn.functional as F
import torch.distributed as dist
from PIL import Image
from easydict import EasyDict
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision import transforms
from torchvision.utils import save_image
from diffusers import AutoencoderKL, UNet2DModel, DDPMScheduler, DDIMScheduler
from diffusers.optimization import get_cosine_schedule_with_warmup

logger = logging.getLogger("ldm")


class ImageFolderFlat(Dataset):
    def __init__(self, root, size):
        self.paths = sorted(glob.glob(os.path.join(root, "**", "*.png"), recursive=True) +
                            glob.glob(os.path.join(root, "**", "*.jpg"), recursive=True))
        self.tf = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size),
                                      transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                      transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB"))


class LDMTrainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.WARN,
                            format="%(asctime)s [%(levelname)s] %(message)s")
        torch.manual_seed(cfg.seed + self.rank)
        if self.rank == 0:
            os.makedirs(os.path.join(cfg.output_dir, "samples"), exist_ok=True)

        # VAE 冻结, 每个进程各自一份, 不需要 DDP
        self.vae = AutoencoderKL.from_pretrained(cfg.vae_path).to(self.device).eval().requires_grad_(False)
        self.scale_factor = cfg.get("latent_scale", 0.18215)

        unet = UNet2DModel(
            sample_size=cfg.resolution // 8, in_channels=4, out_channels=4, layers_per_block=2,
            block_out_channels=(224, 448, 672, 896),
            down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        ).to(self.device)
        self.unet = DDP(unet, device_ids=[self.local_rank])
        self.noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")
        self.sample_scheduler = DDIMScheduler.from_config(self.noise_scheduler.config)

        dataset = ImageFolderFlat(cfg.data_dir, cfg.resolution)
        self.sampler = DistributedSampler(dataset, shuffle=True)
        self.loader = DataLoader(dataset, batch_size=cfg.batch_size_per_gpu, sampler=self.sampler,
                                 num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
        # lr 按总 batch 缩放: cfg.lr 对应总 batch 256
        total_bs = cfg.batch_size_per_gpu * self.world_size
        self.optimizer = torch.optim.AdamW(self.unet.parameters(), lr=cfg.lr * total_bs / 256, weight_decay=1e-2)
        self.total_steps = cfg.epochs * len(self.loader)
        self.lr_scheduler = get_cosine_schedule_with_warmup(self.optimizer, cfg.warmup_steps, self.total_steps)
        self.scaler = torch.cuda.amp.GradScaler()
        self.global_step = 0

    @torch.no_grad()
    def encode(self, x):
        return self.vae.encode(x).latent_dist.sample() * self.scale_factor

    def train_step(self, x):
        latents = self.encode(x)
        noise = torch.randn_like(latents)
        t = torch.randint(0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=self.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, t)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = self.unet(noisy, t).sample
            loss = F.mse_loss(pred.float(), noise)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.unet.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.lr_scheduler.step()
        return loss.detach()

    @torch.no_grad()
    def sample(self, n=16, steps=50):
        """DDIM 采样并用 VAE 解码, 只在 rank0 调用"""
        unet = self.unet.module
        unet.eval()
        latents = torch.randn(n, self.unet.config.in_channels, self.unet.config.sample_size,
                              self.unet.config.sample_size, device=self.device)
        self.sample_scheduler.set_timesteps(steps)
        for t in self.sample_scheduler.timesteps:
            eps = unet(latents, t).sample
            latents = self.sample_scheduler.step(eps, t, latents).prev_sample
        imgs = self.vae.decode(latents / self.scale_factor).sample
        unet.train()
        return (imgs.clamp(-1, 1) + 1) / 2

    def save(self):
        if self.rank != 0:
            return
        path = os.path.join(self.cfg.output_dir, "checkpoint-%d" % self.global_step)
        self.unet.module.save_pretrained(os.path.join(path, "unet"))
        torch.save({"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict(),
                    "step": self.global_step}, os.path.join(path, "training_state.pt"))
        logger.info("保存 checkpoint 到 %s", path)

    def train(self):
        logger.info("样本数 %d, 每卡 batch %d, 总步数 %d", len(self.loader.dataset),
                    self.cfg.batch_size_per_gpu, self.total_steps)
        for epoch in range(self.cfg.epochs):
            self.sampler.set_epoch(epoch)
            self.unet.train()
            t0 = time.time()
            for x in self.loader:
                loss = self.train_step(x.to(self.device, non_blocking=True))
                self.global_step += 1
                if self.global_step % self.cfg.log_every == 0:
                    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
                    logger.info("epoch %d step %d loss %.4f lr %.2e %.2fs/it", epoch, self.global_step,
                                loss.item(), self.lr_scheduler.get_last_lr()[0],
                                (time.time() - t0) / self.cfg.log_every)
                    t0 = time.time()
                if self.global_step % self.cfg.sample_every == 0:
                    if self.rank == 0:
                        imgs = self.sample()
                        save_image(imgs, os.path.join(self.cfg.output_dir, "samples",
                                                      "step_%07d.png" % self.global_step), nrow=4)
                    dist.barrier()
                if self.global_step % self.cfg.save_every == 0:
                    self.save()
        self.save()
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/ldm_ffhq256.yaml")
    args = parser.parse_args()
    with open(args.config) as f:
        cfg = EasyDict(yaml.safe_load(f))
    LDMTrainer(cfg).train()
