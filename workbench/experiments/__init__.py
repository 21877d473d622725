"""One module (or package) per notebook, same name as `notebooks/<name>.ipynb`.

Each holds the notebook's experiment functions (they return pandas DataFrames) and its pure plot
functions (`plot_x(df, ...) -> Figure`); widget callbacks call into it. Techniques live in their
own packages (`workbench.optim`, `workbench.checkpoint`, ...) and know nothing of these.
"""
