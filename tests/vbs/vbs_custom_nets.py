"""Small models with forwards of their own, shared by the workbench.vbs graph and executor tests:
a look-alike of a residual block, a user's non-Sequential model, gates and nested branches, a
module torch.fx cannot trace."""

import torch
import torch.nn.functional as F
from torch import nn


class LookAlike(nn.Module):
    """The attributes of a residual block (body, shortcut, relu), but another forward."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
                                  nn.Conv2d(c, c, 3, padding=1))
        self.shortcut = nn.Conv2d(c, c, 1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.body(x)) - 0.5 * self.shortcut(x)


class LookAlikeSum(LookAlike):
    """relu(body(x)) + shortcut(x): a sum of two branches, but the ReLU is inside the first."""

    def forward(self, x):
        return self.relu(self.body(x)) + self.shortcut(x)


class UserNet(nn.Module):
    """A user's own model: no Sequential, functional ReLUs, a residual sum, flatten in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.proj = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x) + self.proj(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


class Branchy(nn.Module):
    """A gate (x * sigmoid), a sum of three, a nested residual inside a residual, a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        x = x * torch.sigmoid(self.a(x))
        x = self.a(x) + self.b(x) + self.c(x)
        x = x + (self.b(x) + self.c(self.a(x)))
        x = x.max(dim=1, keepdim=True)[0]
        return x.view(x.size(0), -1)


class DataDependent(nn.Module):
    def forward(self, x):
        if x.dim() == 4:  # control flow on a traced value: torch.fx cannot follow it
            return F.relu(x) * 2
        return x


def look_alike_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), LookAlike(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 3)).eval()


CUSTOM = {
    "look_alike": look_alike_net,
    "look_alike_sum": lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), LookAlikeSum(8), nn.Flatten()).eval(),
    "user_net": lambda: UserNet().eval(),
    "branchy": lambda: nn.Sequential(nn.Conv2d(3, 4, 1), Branchy()).eval(),
}
