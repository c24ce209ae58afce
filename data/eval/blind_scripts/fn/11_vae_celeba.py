"""beta-VAE on CelebA 64x64.

    torchrun --nproc_per_node=2 11_vae_celeba.py model.latent_dim=128 loss.beta=4.0
"""
import logging
import os

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image

log = logging.getLogger(__name__)


def conv_block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2))


def deconv_block(cin, cout):
    return nn.Sequential(nn.ConvTranspose2d(cin, cout, 3, stride=2, padding=1, output_padding=1),
                         nn.BatchNorm2d(cout), nn.LeakyReLU(0.2))


class BetaVAE(nn.Module):
    def __init__(self, latent_dim=128, hidden_dims=(32, 64, 128, 256, 512)):
        super().__init__()
        self.latent_dim = latent_dim
        enc, cin = [], 3
        for h in hidden_dims:
            enc.append(conv_block(cin, h))
            cin = h
        self.encoder = nn.Sequential(*enc)
        self.fc_mu = nn.Linear(hidden_dims[-1] * 4, latent_dim)
        self.fc_var = nn.Linear(hidden_dims[-1] * 4, latent_dim)
        self.decoder_input = nn.Linear(latent_dim, hidden_dims[-1] * 4)
        rev = list(hidden_dims)[::-1]
        self.decoder = nn.Sequential(*[deconv_block(rev[i], rev[i + 1]) for i in range(len(rev) - 1)])
        self.final = nn.Sequential(deconv_block(rev[-1], rev[-1]), nn.Conv2d(rev[-1], 3, 3, padding=1), nn.Tanh())
        self.top_dim = hidden_dims[-1]

    def encode(self, x):
        h = torch.flatten(self.encoder(x), 1)
        return self.fc_mu(h), self.fc_var(h)

    def decode(self, z):
        h = self.decoder_input(z).view(-1, self.top_dim, 2, 2)
        return self.final(self.decoder(h))

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar

    def loss_function(self, recon, x, mu, logvar, beta, kld_weight):
        recon_loss = F.mse_loss(recon, x)
        kld = torch.mean(-0.5 * torch.sum(1 + logvar - mu ** 2 - logvar.exp(), dim=1), dim=0)
        return recon_loss + beta * kld_weight * kld, recon_loss.detach(), kld.detach()

    @torch.no_grad()
    def sample(self, n, device):
        z = torch.randn(n, self.latent_dim, device=device)
        return self.decode(z)


@hydra.main(version_base=None, config_path="configs", config_name="vae")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir
    os.makedirs(os.path.join(out_dir, "samples"), exist_ok=True)

    tf = transforms.Compose([
        transforms.RandomHorizontalFlip(),
        transforms.CenterCrop(148),
        transforms.Resize(cfg.data.image_size),
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    ])
    train_set = datasets.CelebA(to_absolute_path(cfg.data.root), split="train", transform=tf, download=False)
    val_set = datasets.CelebA(to_absolute_path(cfg.data.root), split="valid", transform=tf, download=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg.data.batch_size,
                            sampler=DistributedSampler(val_set, shuffle=False, drop_last=True),
                            num_workers=cfg.data.workers, pin_memory=True, drop_last=True)

    model = instantiate(cfg.model)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = instantiate(cfg.optim, params=model.parameters())
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=cfg.sched.gamma)

    # M / N weighting of the KL term (minibatch size over dataset size, per GPU)
    kld_weight = cfg.data.batch_size / len(train_sampler)
    fixed_z = torch.randn(64, cfg.model.latent_dim, device=device)

    step = 0
    for epoch in range(cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, _ in train_loader:
            x = x.to(device, non_blocking=True)
            recon, mu, logvar = model(x)
            loss, rec, kld = model.loss_function(recon, x, mu, logvar, cfg.loss.beta, kld_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and step % cfg.train.log_every == 0:
                log.info("ep %d step %d loss %.4f rec %.4f kld %.3f", epoch, step, loss.item(), rec.item(), kld.item())
            step += 1
        scheduler.step()

        model.eval()
        stats = torch.zeros(3, device=device)
        with torch.no_grad():
            for x, _ in val_loader:
                x = x.to(device, non_blocking=True)
                recon, mu, logvar = model(x)
                rec = F.mse_loss(recon, x, reduction="sum") / x[0].numel()
                kld = (-0.5 * torch.sum(1 + logvar - mu ** 2 - logvar.exp(), dim=1)).sum()
                stats += torch.stack([rec, kld, torch.tensor(float(x.size(0)), device=device)])
        dist.all_reduce(stats)
        if rank == 0:
            log.info("epoch %d val rec %.4f kld %.3f", epoch, (stats[0] / stats[2]).item(),
                     (stats[1] / stats[2]).item())
            with torch.no_grad():
                samples = model.module.decode(fixed_z)
            save_image(samples * 0.5 + 0.5, os.path.join(out_dir, "samples", f"ep{epoch:03d}.png"), nrow=8)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch, "cfg": OmegaConf.to_container(cfg, resolve=True)},
                       os.path.join(out_dir, "vae_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
