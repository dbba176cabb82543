"""The run folders on disk: `CellFolder` (cell.py) owns every file name of a cell's folder, `MatrixFolder`
(matrix.py) every name of runs/<matrix>/. Every other module asks them for a path.

May import: core.
"""
